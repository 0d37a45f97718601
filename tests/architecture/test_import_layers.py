"""The package's import structure: lower layers never import higher ones, no module imports itself in a circle, and
the Triton code is imported only when a Triton step runs.

Read statically from the source (``ast`` over ``hf_optim/**/*.py``, imports inside functions included: a lazy
import closes a cycle all the same, it only hides it until that function runs). Without cycles, any module can be
imported first in a fresh interpreter; a subprocess test checks that for the modules that used to form one.

Below the optimizers the floors are strict, each importing only those beneath it: ``numerics/`` (exact math),
``formats/`` (state formats), ``core/`` (descriptions and slots), then ``kernels/`` (the two compute paths and the
choice between them) beside ``paging/``. ``formats/`` and ``kernels/torch_path/`` never import ``triton`` or
``triton_path/``, even lazily (they are the path of machines without Triton); outside
``triton_path/`` and the algorithms' ``triton_rule`` modules nothing imports them at module level, and importing
the package loads none of them (a subprocess test). ``gpu_static/`` (the ahead-of-time compile table) is a tool on the
top floor: it imports triton when imported, so no module of the package imports it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from import_graph import MODULES, import_nodes, imports  # noqa: E402  (tools/ is a folder of scripts)

FLOORS = (("hf_optim.numerics",), ("hf_optim.formats",), ("hf_optim.core",), ("hf_optim.kernels", "hf_optim.paging"))
"""The floors below the optimizers, lowest first: a module imports only its own floor and those beneath it."""
LOWER = tuple(part for floor in FLOORS for part in floor)
HIGHER = ("hf_optim.optim", "hf_optim.integrations", "hf_optim.recipes", "hf_optim.monitor")


def imports_triton(name: str, module_level: bool = False) -> list[int]:
    """The lines of module ``name`` that import the ``triton`` package itself."""
    lines = []
    for node in import_nodes(name, module_level):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if not getattr(node, "level", 0) and any(n.split(".")[0] == "triton" for n in names):
            lines.append(node.lineno)
    return lines


def in_layer(name: str, layers: tuple[str, ...]) -> bool:
    return any(name == layer or name.startswith(layer + ".") for layer in layers)


def test_the_walk_sees_the_package():
    assert len(MODULES) > 50 and "hf_optim.kernels.triton_path.step" in MODULES
    targets = {target for target, _ in imports("hf_optim.optim.adamw")}
    assert {"hf_optim.core.algorithm", "hf_optim.numerics.exact_math", "hf_optim.optim.base"} <= targets
    # lazy (function-level) imports count: the runner imports triton_step inside triton_plans
    assert "hf_optim.kernels.triton_path.step" in {target for target, _ in imports("hf_optim.optim.runner")}


def test_lower_layers_never_import_higher_ones():
    bad = [
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
        for name in MODULES if in_layer(name, LOWER)
        for target, line in imports(name)
        if in_layer(target, HIGHER) or target == "hf_optim"  # the package's __init__ imports every layer
    ]
    assert not bad, "numerics/, formats/, core/, kernels/, paging/ must not import optim/, integrations/, " \
        "recipes/, monitor/ (pass what they need instead):\n" + "\n".join(bad)


TRITON_PATH = "hf_optim.kernels.triton_path"
NO_TRITON = ("hf_optim.formats", "hf_optim.kernels.torch_path")
GUARD = f"{TRITON_PATH}.guard"
"""The one module of triton_path/ that does not import triton: the compile-before-launch fallback, whose record of
failed configurations the doctor and the backend's name read on machines without Triton too."""


def is_triton_code(name: str) -> bool:
    """The Triton path's modules (but :data:`GUARD`) and the algorithms' Triton rules and passes
    (``hf_optim/optim/<algorithm>/triton_rule.py``, ``triton_passes.py``)."""
    return (in_layer(name, (TRITON_PATH,)) and name != GUARD) or name.endswith((".triton_rule", ".triton_passes"))


def floor_of(name: str) -> int | None:
    return next((i for i, floor in enumerate(FLOORS) if in_layer(name, floor)), None)


def imports_upward(name: str, target: str) -> bool:
    """Whether ``name``, on a lower floor, importing hf_optim module ``target`` breaks the floors."""
    return (floor_of(name) is not None and target.startswith("hf_optim.")
            and (floor_of(target) is None or floor_of(target) > floor_of(name)))


def test_each_lower_floor_imports_only_the_floors_beneath_it():
    bad = [f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
           for name in MODULES for target, line in imports(name) if imports_upward(name, target)]
    assert not bad, "the floors are numerics/ < formats/ < core/ < kernels/, paging/: move the shared piece down " \
        "a floor rather than importing up:\n" + "\n".join(bad)


def test_the_floors_check_refuses_an_import_upwards_and_allows_one_downwards():
    assert imports_upward("hf_optim.formats.fp8", "hf_optim.kernels.torch_path.rounding")
    assert imports_upward("hf_optim.numerics.rounding", "hf_optim.formats.dynamic_map")
    assert imports_upward("hf_optim.core.algorithm", "hf_optim.optim.base")
    assert not imports_upward("hf_optim.core.algorithm", "hf_optim.formats")
    assert not imports_upward("hf_optim.kernels.backend", "hf_optim.core.state_store")
    assert not imports_upward("hf_optim.optim.base", "hf_optim.recipes")  # above the floors: other tests' concern


def test_the_kernels_folders_are_what_their_names_say():
    folders = {name.rpartition(".")[0] for name in MODULES if name.startswith("hf_optim.kernels.")
               and MODULES[name].name != "__init__.py"}
    assert folders == {"hf_optim.kernels", "hf_optim.kernels.torch_path", TRITON_PATH}
    top = {name for name in MODULES if name.rpartition(".")[0] == "hf_optim.kernels"
           and MODULES[name].name != "__init__.py"}
    assert top == {"hf_optim.kernels.backend"}, \
        "hf_optim/kernels/ holds the two compute paths and, at its top, only the backend choice: put a " \
        "description in core/, a format in formats/, shared exact math in numerics/"
    # every module of triton_path/ but the guard imports triton when imported
    without = {name for name in MODULES if in_layer(name, (TRITON_PATH,)) and MODULES[name].name != "__init__.py"
               and not imports_triton(name, module_level=True)
               and not any(is_triton_code(target) for target, _ in imports(name, module_level=True))}
    assert without == {GUARD}
    assert not imports_triton(GUARD, module_level=True)


def test_formats_and_the_torch_path_never_import_triton():
    bad = [f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
           for name in MODULES if in_layer(name, NO_TRITON)
           for target, line in imports(name) if is_triton_code(target)]
    bad += [f"{MODULES[name].relative_to(ROOT)}:{line} imports triton"
            for name in MODULES if in_layer(name, NO_TRITON) for line in imports_triton(name)]
    assert not bad, "formats/ and torch_path/ run where Triton is missing, so they never import it (not even in " \
        "a function):\n" + "\n".join(bad)


AOT_TOOL = "hf_optim.gpu_static"
"""The ahead-of-time compile table (``python -m hf_optim.gpu_static``): a tool on the top floor that compiles the
kernels without a GPU, so it imports triton when imported."""
AOT_TOOL_READS = (*LOWER, "hf_optim.optim")
"""What the tool may import: the floors and the optimizers (their registry and options), nothing beside it."""


def test_triton_code_is_imported_only_when_a_triton_step_runs():
    """Outside triton_path/ and the Triton rules, no module imports them, or triton, at module level: they are
    imported by the step that needs them (``hf_optim.optim.runner``) or named as ``"module:attribute"``. The
    ahead-of-time tool (:data:`AOT_TOOL`) imports triton itself, and nothing imports the tool."""
    bad = [f"{MODULES[name].relative_to(ROOT)}:{line} imports {target} at module level"
           for name in MODULES if not is_triton_code(name)
           for target, line in imports(name, module_level=True) if is_triton_code(target)]
    bad += [f"{MODULES[name].relative_to(ROOT)}:{line} imports triton at module level"
            for name in MODULES if not is_triton_code(name) and not in_layer(name, (AOT_TOOL,))
            for line in imports_triton(name, module_level=True)]
    assert not bad, "\n".join(bad)


def test_nothing_imports_the_ahead_of_time_tool_and_it_reads_only_below_it():
    bad = [f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
           for name in MODULES if not in_layer(name, (AOT_TOOL,))
           for target, line in imports(name) if in_layer(target, (AOT_TOOL,))]
    assert not bad, f"{AOT_TOOL} imports triton when imported: nothing in the package imports it\n" + "\n".join(bad)
    names = [name for name in MODULES if in_layer(name, (AOT_TOOL,))]
    assert f"{AOT_TOOL}.cli" in names and f"{AOT_TOOL}.__main__" in names
    bad = [f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}" for name in names
           for target, line in imports(name) if not in_layer(target, (AOT_TOOL, *AOT_TOOL_READS))]
    assert not bad, f"{AOT_TOOL} reads only {', '.join(AOT_TOOL_READS)}:\n" + "\n".join(bad)


def test_importing_the_package_loads_no_triton_code():
    code = ("import sys, hf_optim, hf_optim.optim.registry\n"
            "for family in hf_optim.optim.registry.families():\n"
            "    family.base(__import__('torch').nn.Linear(2, 2).parameters())\n"
            f"print(sorted(m for m in sys.modules if m.startswith(('{TRITON_PATH}', '{AOT_TOOL}'))"
            " or m.endswith(('.triton_rule', '.triton_passes'))))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_each_multi_pass_algorithm_keeps_its_triton_passes_beside_it():
    """A built-in algorithm with passes of its own (LAMB, Adafactor) names its Triton step and their launch specs in
    ``triton_passes.py`` of its own package, so that one algorithm is one folder."""
    from hf_optim.optim import registry

    found = []
    for family in registry.families():
        algorithm, package = family.algorithm, family.base.__module__
        if not package.startswith("hf_optim.optim.") or algorithm.triton_plan.elementwise:
            continue
        found.append(algorithm.name)
        assert algorithm.package == package, algorithm.name  # relative references resolve in its own package
        assert algorithm.triton_plan.step == ".triton_passes:step", algorithm.name
        assert algorithm.triton_plan.specs == ".triton_passes:launch_specs", algorithm.name
        assert f"{package}.triton_passes" in MODULES
    assert sorted(found) == ["adafactor", "lamb"]


def test_each_elementwise_algorithm_keeps_its_triton_rule_beside_it():
    """A built-in elementwise algorithm's Triton rule is ``triton_rule.py`` in the algorithm's own package."""
    from hf_optim.optim import registry

    for family in registry.families():
        algorithm = family.algorithm
        package = family.base.__module__
        if not package.startswith("hf_optim.optim.") or algorithm.triton_rule is None:
            continue
        assert isinstance(algorithm.triton_rule, str), algorithm.name
        assert algorithm.package == package, algorithm.name  # relative references resolve in its own package
        assert algorithm.triton_rule == f".triton_rule:{algorithm.name}", algorithm.triton_rule
        assert MODULES[package].name == "__init__.py" and f"{package}.triton_rule" in MODULES


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
    order = ["hf_optim.optim.adafactor.triton_passes", "hf_optim.kernels.triton_path.step",
             "hf_optim.optim.adafactor", "hf_optim.optim.base", "hf_optim"]
    code = f"import importlib\nfor name in {order!r}:\n    importlib.import_module(name)\nprint('imported')\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "imported"


def test_the_architecture_diagram_is_the_current_import_graph():
    """docs/architecture.md shows what ``python tools/import_graph.py`` prints now: a part or an import added or
    removed without the diagram following fails here (run the tool and paste its output)."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "import_graph.py")], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() in (ROOT / "docs" / "architecture.md").read_text(), done.stdout
