"""The package's import structure as a Mermaid diagram, read from the source: one box per part, one arrow per import.

A part is a sub-package (``hf_optim.formats``, ``hf_optim.optim``, ...) or a top-level module grouped with
its kind (the command line, the start-up hooks). An arrow ``a --> b`` means some module of ``a`` imports one of ``b``,
at module level or inside a function (a lazy import is a dependency all the same). ``docs/architecture.md`` holds the
output. ``tests/architecture/test_import_layers.py`` reads the package's imports through :func:`imports` too (its
layering rules), and checks that the diagram is current.

    python tools/import_graph.py
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_optim"

PARTS = {
    "numerics": ("numerics: exact math, stochastic rounding", ["hf_optim.numerics"]),
    "formats": ("formats: state formats", ["hf_optim.formats"]),
    "core": ("core: algorithm descriptions, partitions, slots", ["hf_optim.core"]),
    "torch_path": ("kernels/torch_path: PyTorch and inductor path", ["hf_optim.kernels.torch_path"]),
    "triton_path": ("kernels/triton_path: Triton kernels", ["hf_optim.kernels.triton_path"]),
    "kernels": ("kernels: backend choice", ["hf_optim.kernels"]),
    "paging": ("paging: CUDA managed memory", ["hf_optim.paging"]),
    "optim": ("optim: optimizer classes, algorithms, registry", ["hf_optim.optim"]),
    "integrations": ("integrations: Trainer and TRL names", ["hf_optim.integrations"]),
    "recipes": ("recipes: hf-optim train, --fit, estimates", ["hf_optim.recipes", "hf_optim.tiny",
                                                           "hf_optim.checkpoints"]),
    "monitor": ("monitor: memory and loss logs, plots", ["hf_optim.monitor"]),
    "doctor": ("doctor: hf-optim doctor", ["hf_optim.doctor"]),
    "gpu_static": ("gpu_static: ahead-of-time compile table (no GPU)", ["hf_optim.gpu_static"]),
    "entry": ("entry points: import hf_optim, the CLI, notebooks", ["hf_optim"]),
    "shared": ("shared leaves: errors, notices, memory units", ["hf_optim.errors", "hf_optim.notices",
                                                                "hf_optim.memory"]),
}
"""Each part's label and module prefixes; a module belongs to the part of the longest prefix it starts with."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def import_nodes(name: str, module_level: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of module ``name``: all of them, or (``module_level``) only those that run when the
    module is imported (not inside a function body)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    if not module_level:
        return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    found, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))
    return found


def imports(name: str, module_level: bool = False) -> list[tuple[str, int]]:
    """(imported hf_optim module, line) for every import statement of module ``name`` (``module_level``: only those
    that run when it is imported)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in import_nodes(name, module_level):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "hf_optim"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "hf_optim":
                continue
            for alias in node.names:  # ``from pkg import module`` imports the module; ``from module import x`` not
                submodule = f"{base}.{alias.name}"
                found.append((submodule if submodule in MODULES else base, node.lineno))
    return found


def part_of(module: str) -> str:
    matches = [(len(prefix), part) for part, (_, prefixes) in PARTS.items() for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1]


def edges() -> set[tuple[str, str]]:
    """(importing part, imported part) pairs, each part's own imports left out."""
    found = set()
    for name in MODULES:
        for imported, _ in imports(name):
            source, target = part_of(name), part_of(imported)
            if source != target:
                found.add((source, target))
    return found


def mermaid() -> str:
    order = list(PARTS)
    lines = ["```mermaid", "graph TD"]
    lines += [f'    {part}["{label}"]' for part, (label, _) in PARTS.items()]
    lines += [f"    {a} --> {b}" for a, b in sorted(edges(), key=lambda e: (order.index(e[0]), order.index(e[1])))]
    lines.append("```")
    return "\n".join(lines)


if __name__ == "__main__":
    print(mermaid())
