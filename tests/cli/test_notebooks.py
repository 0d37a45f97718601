"""The notebooks in notebooks/: static checks (structure, badges, secrets, keyword arguments the installed
libraries accept) and a top-to-bottom smoke execution of each one, as CI runs it."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"


def _load_build():
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOK_DIR / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()
NAMES = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK_DIR / name, as_version=4)


def tags(cell) -> list[str]:
    return cell.metadata.get("tags", [])


def python_source(cell) -> str:
    """A code cell's source with IPython magics / shell lines blanked (they are not Python)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines())


def test_committed_notebooks_are_the_built_ones():
    built = build.all_notebooks()
    assert NAMES == sorted(built), "notebooks/ and notebooks/build.py disagree: run python notebooks/build.py"
    for name, notebook in built.items():
        committed = read(name)
        assert [(c.cell_type, c.source, tags(c)) for c in committed.cells] == \
            [(c.cell_type, c.source, tags(c)) for c in notebook.cells], \
            f"{name} is stale: run python notebooks/build.py --execute {name}"


@pytest.mark.parametrize("name", NAMES)
def test_structure(name):
    notebook = read(name)
    nbformat.validate(notebook)
    json.loads((NOTEBOOK_DIR / name).read_text())  # plain JSON as well, for tools that are not nbformat

    parameters = [c for c in notebook.cells if build.PARAMETERS in tags(c)]
    assert len(parameters) == 1 and parameters[0].cell_type == "code", "exactly one code cell tagged 'parameters'"
    statements = ast.parse(parameters[0].source).body
    assert statements and all(isinstance(s, ast.Assign) for s in statements), "parameters cell: assignments only"

    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        source = cell.source
        installs = re.search(r"^\s*[%!]\s*pip\b", source, re.M) is not None
        tree = ast.parse(python_source(cell))  # every code cell is valid Python
        logs_in = any(isinstance(n, ast.Call) and _call_name(n) in {"login", "notebook_login", "interpreter_login"}
                      for n in ast.walk(tree))
        if installs or logs_in:
            assert build.SKIP_CI in tags(cell), f"{name}: install / login cell not tagged {build.SKIP_CI!r}"


@pytest.mark.parametrize("name", NAMES)
def test_colab_badge_points_at_this_notebook(name):
    first = read(name).cells[0]
    urls = re.findall(r"\((https://colab\.research\.google\.com/github/[^)\s]+)\)", first.source)
    assert len(urls) == 1, "the first cell carries one Colab badge"
    prefix = f"https://colab.research.google.com/github/{build.REPOSITORY}/blob/{build.BRANCH}/"
    assert urls[0].startswith(prefix), urls[0]
    path = ROOT / urls[0].removeprefix(prefix)
    assert path.is_file() and path.resolve() == (NOTEBOOK_DIR / name).resolve(), urls[0]
    assert "colab-badge.svg" in first.source


SECRET_PATTERNS = {
    "Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{30,}"),
    "GitHub token": re.compile(r"\b(ghp|gho|ghs|ghu|github_pat)_[A-Za-z0-9_]{20,}"),
    "OpenAI-style key": re.compile(r"\bsk-[A-Za-z0-9]{20,}"),
    "AWS access key": re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    "W&B / bearer token": re.compile(r"(?i)\b(wandb_api_key|authorization: bearer)\b\s*[:=]?\s*\S{20,}"),
    "token assignment": re.compile(r"(?i)\b(hf_)?token\s*=\s*['\"][^'\"]{8,}['\"]"),
}


def test_secret_patterns_catch_tokens():
    fake = "hf_" + "a1B2" * 9  # built here so the repository holds no token-shaped string
    assert SECRET_PATTERNS["Hugging Face token"].search(f"token: {fake}")
    assert SECRET_PATTERNS["token assignment"].search(f'login(token="{fake}")')


@pytest.mark.parametrize("name", NAMES)
def test_no_secrets_in_sources_or_outputs(name):
    text = (NOTEBOOK_DIR / name).read_text()
    for what, pattern in SECRET_PATTERNS.items():
        match = pattern.search(text)
        assert match is None, f"{name}: looks like a {what}: {match.group(0)[:12]}..."


# ---- keyword arguments against the installed libraries -------------------------------------------------------


def _accepted(cls) -> set[str]:
    """Keywords ``cls(...)`` accepts: its ``__init__``'s named parameters (a dataclass's are its init fields)."""
    params = inspect.signature(cls.__init__).parameters
    # **kwargs (BitsAndBytesConfig has one) swallows typos with a warning at best: only named parameters count.
    return {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}


def _checked_classes() -> dict:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    import hf_optim  # noqa: F401  (optim= names, as in the notebooks)

    return {c.__name__: c for c in (SFTConfig, LoraConfig, BitsAndBytesConfig, SFTTrainer, TrainingArguments, Trainer)}


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _dict_keys(node) -> list[str] | None:
    """Keys of ``dict(a=...)`` or ``{"a": ...}``, else None."""
    if isinstance(node, ast.Call) and _call_name(node) == "dict":
        return [k.arg for k in node.keywords if k.arg]
    if isinstance(node, ast.Dict):
        return [k.value for k in node.keys if isinstance(k, ast.Constant)]
    return None


def notebook_calls(notebook) -> list[tuple[str, str, ast.Call]]:
    """Every call in a notebook's code cells, with ``**name`` expansions of dicts the notebook builds resolved."""
    trees = [ast.parse(python_source(c)) for c in notebook.cells if c.cell_type == "code"]
    dicts = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                keys = _dict_keys(node.value)
                if keys is not None:
                    dicts[node.targets[0].id] = keys
    calls = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _call_name(node):
                for keyword in node.keywords:
                    if keyword.arg is not None:
                        calls.append((_call_name(node), keyword.arg, node))
                    elif isinstance(keyword.value, ast.Name) and keyword.value.id in dicts:
                        calls += [(_call_name(node), key, node) for key in dicts[keyword.value.id]]
                    else:  # an expansion the check cannot see into: fails the check if the callee is a checked one
                        calls.append((_call_name(node), f"**{ast.unparse(keyword.value)}", node))
    return calls


def test_keyword_arguments_accepted_by_installed_versions():
    classes = _checked_classes()
    accepted = {name: _accepted(cls) for name, cls in classes.items()}
    seen = set()
    for name in NAMES:
        for callee, keyword, node in notebook_calls(read(name)):
            if callee not in accepted:
                continue
            seen.add(callee)
            assert keyword in accepted[callee], (
                f"{name} line {node.lineno}: {callee}({keyword}=...) is not accepted by the installed "
                f"{classes[callee].__module__.split('.')[0]}")
    # The four the issue names must really be exercised (no vacuous pass).
    assert {"SFTConfig", "LoraConfig", "BitsAndBytesConfig", "SFTTrainer"} <= seen, seen


def test_keyword_check_catches_a_misspelling():
    bad = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "args = dict(max_step=1)\nSFTConfig(output_dir='x', **args)\nLoraConfig(lora_rr=8)")])
    accepted = {name: _accepted(cls) for name, cls in _checked_classes().items()}
    rejected = {(callee, kw) for callee, kw, _ in notebook_calls(bad) if callee in accepted
                and kw not in accepted[callee]}
    assert rejected == {("SFTConfig", "max_step"), ("LoraConfig", "lora_rr")}


def test_optimizer_names_exist():
    """Every optim= name the notebooks use is valid (the deliberate typo inside a try: block excepted)."""
    from transformers.training_args import OptimizerNames

    import hf_optim  # noqa: F401

    valid = {n.value for n in OptimizerNames}
    used, demo = set(), set()
    for name in NAMES:
        for cell in read(name).cells:
            if cell.cell_type != "code":
                continue
            tree = ast.parse(python_source(cell))
            in_try = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for s in t.body for n in ast.walk(s)}
            for node in ast.walk(tree):
                if isinstance(node, ast.keyword) and node.arg == "optim" and isinstance(node.value, ast.Constant):
                    (demo if id(node) in in_try else used).add(node.value.value)
                if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) \
                        and node.targets[0].id in {"OPTIM", "OPTIMIZERS", "BASELINE"}:
                    value = ast.literal_eval(node.value)
                    used |= set(value) if isinstance(value, list) else {value}
    assert used and used <= valid, used - valid
    assert demo and not demo & valid, "the did-you-mean demo must use an invalid name"


# ---- committed outputs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_committed_outputs_come_from_a_labelled_run(name):
    """Every runnable cell was executed, no cell errored, and the outputs say they come from a CPU smoke run."""
    from hf_optim.notebook import SMOKE_BANNER

    notebook = read(name)
    runnable = [c for c in notebook.cells if c.cell_type == "code" and build.SKIP_CI not in tags(c)]
    assert all(c.execution_count for c in runnable), f"{name}: run python notebooks/build.py --execute {name}"
    outputs = [o for c in runnable for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert SMOKE_BANNER in printed
    assert "smoke run" in notebook.cells[0].source.lower()


# ---- execution -------------------------------------------------------------------------------------------------

# What each notebook must leave behind in its working directory when it ran to the end.
EXPECTED_FILES = {
    "01_quickstart_qlora_1b.ipynb": ["outputs/quickstart/summary.json", "outputs/quickstart/dashboard.png",
                                     "outputs/quickstart/adapter/adapter_model.safetensors"],
    "02_optimizer_shootout_1b.ipynb": ["outputs/shootout/compare/compare.md",
                                       "outputs/shootout/best_model/config.json"],
    "03_qlora_8b_t4.ipynb": ["outputs/qlora_8b/summary.json", "outputs/qlora_8b/adapter/adapter_model.safetensors"],
    "04_bring_your_own_trainer.ipynb": ["outputs/byo_trainer/lamb_8bit/summary.json",
                                        "outputs/byo_trainer/ademamix_8bit/summary.json",
                                        "outputs/byo_trainer/bnb_adamw8bit.pt",
                                        "outputs/byo_trainer/adapter/hf_optim_adamw8bit.pt"],
}


def test_every_notebook_has_expected_files():
    assert sorted(EXPECTED_FILES) == NAMES


@pytest.mark.slow  # ~20-40 s each: a kernel start, imports, and a few training steps of a tiny model
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom_in_smoke_mode(name, tmp_path):
    executed = build.execute(read(name), tmp_path)  # a failing cell raises CellExecutionError
    for relative in EXPECTED_FILES[name]:
        assert (tmp_path / relative).is_file(), relative
    skipped = [c for c in executed.cells if build.SKIP_CI in tags(c)]
    assert skipped and all(not c.get("outputs") for c in skipped)
    if name.startswith("02_"):
        table = (tmp_path / "outputs/shootout/compare/compare.md").read_text()
        for optimizer in ["adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor",
                          "lamb_8bit", "ademamix_8bit"]:
            assert f"| {optimizer} " in table, optimizer
    if name.startswith("04_"):
        printed = "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
        assert "8-bit moments identical after loading: True" in printed
