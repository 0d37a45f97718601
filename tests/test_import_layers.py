"""The package's import structure: lower layers never import higher ones, and no module imports itself in a circle.

Read statically from the source (``ast`` over ``hf_optim/**/*.py``, imports inside functions included: a lazy
import closes a cycle all the same, it only hides it until that function runs). Without cycles, any module can be
imported first in a fresh interpreter; a subprocess test checks that for the modules that used to form one.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_optim"
LOWER = ("hf_optim.kernels", "hf_optim.paging")
HIGHER = ("hf_optim.optim", "hf_optim.integrations", "hf_optim.recipes", "hf_optim.monitor")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> list[tuple[str, int]]:
    """(imported hf_optim module, line) for every import statement of module ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def in_layer(name: str, layers: tuple[str, ...]) -> bool:
    return any(name == layer or name.startswith(layer + ".") for layer in layers)


def test_the_walk_sees_the_package():
    assert len(MODULES) > 50 and "hf_optim.kernels.triton_step" in MODULES
    targets = {target for target, _ in imports("hf_optim.optim.adamw")}
    assert {"hf_optim.kernels.algorithm", "hf_optim.kernels.exact_math", "hf_optim.optim.base"} <= targets
    # lazy (function-level) imports count: dispatch imports triton_step inside _update_group
    assert "hf_optim.kernels.triton_step" in {target for target, _ in imports("hf_optim.optim.dispatch")}


def test_lower_layers_never_import_higher_ones():
    bad = [
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
        for name in MODULES if in_layer(name, LOWER)
        for target, line in imports(name)
        if in_layer(target, HIGHER) or target == "hf_optim"  # the package's __init__ imports every layer
    ]
    assert not bad, "hf_optim/kernels and hf_optim/paging must not import optim/, integrations/, recipes/, " \
        "monitor/ (pass what they need instead):\n" + "\n".join(bad)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a closed path), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = {name: {target for target, _ in imports(name) if target in MODULES and target != name}
             for name in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_kernels_import_first_in_a_fresh_interpreter():
    """The modules that used to form a cycle (optim/base -> kernels/triton_step -> kernels/triton_adafactor ->
    optim/adafactor -> optim/base), the kernels first, then the package (one subprocess: the static check above
    covers every other order)."""
    order = ["hf_optim.kernels.triton_adafactor", "hf_optim.kernels.triton_step", "hf_optim.optim.adafactor",
             "hf_optim.optim.base", "hf_optim"]
    code = f"import importlib\nfor name in {order!r}:\n    importlib.import_module(name)\nprint('imported')\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "imported"
