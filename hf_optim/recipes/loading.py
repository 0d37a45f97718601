"""Reading recipe files: YAML, ``extends:`` (deep merge), dotted command-line overrides, and bundled recipes.

Every leaf value remembers the file (or ``command line``) it came from, so errors name the right file.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hf_optim.recipes.errors import RecipeError, RecipeIssue

COMMAND_LINE = "command line"
SECTIONS = ("model", "quantization", "peft", "training", "data", "logging")


def bundled_dir() -> Path:
    """The directory of bundled recipes: ``recipes/`` of a source checkout, else the installed copy
    (``hf_optim.bundled_recipes``, which ``pyproject.toml`` maps onto the same directory)."""
    package = Path(__file__).resolve().parent.parent
    checkout = package.parent / "recipes"
    if (package.parent / "pyproject.toml").is_file() and checkout.is_dir():
        return checkout  # a source checkout or an editable install
    return package / "bundled_recipes"  # a wheel (setup.py maps recipes/ there)


def bundled_names() -> list[str]:
    """Names of the bundled recipes (file stems), sorted."""
    return sorted(p.stem for p in bundled_dir().glob("*.yaml"))


def find_recipe(name_or_path: str | Path, relative_to: Path | None = None) -> Path:
    """A recipe file: an existing path (tried relative to ``relative_to`` first), else a bundled recipe name."""
    candidate = Path(name_or_path)
    tries = ([relative_to / candidate] if relative_to is not None else []) + [candidate]
    for path in tries:
        if path.is_file():
            return path
    return bundled_recipe(str(name_or_path))


def bundled_recipe(name: str) -> Path:
    """The bundled recipe called ``name`` (with or without ``.yaml``); an error with the closest names if none."""
    stem = _stem(name)
    bundled = bundled_dir() / f"{stem}.yaml"
    if bundled.is_file():
        return bundled
    raise RecipeError([RecipeIssue(name, "", f"no such file or bundled recipe{_bundled_hint(stem)} "
                                   "(`hf-optim ls` lists the bundled ones)")])


def _stem(name: str) -> str:
    return Path(name).name.removesuffix(".yaml").removesuffix(".yml")


def _bundled_hint(stem: str) -> str:
    """``; did you mean 'quickstart'?`` for the bundled names closest to ``stem``; empty if none is close."""
    from hf_optim.errors import suggest

    close = suggest(stem, bundled_names())
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def display_path(path: Path) -> str:
    """``path`` relative to the working directory when it is below it (as users typed it), else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


@dataclass
class RawRecipe:
    """A merged recipe before validation.

    Attributes:
        data: the merged mapping (``extends`` removed).
        source: display name of the recipe file.
        origins: file that set each key path (dotted), for error messages.
    """

    data: dict[str, Any]
    source: str
    origins: dict[str, str] = field(default_factory=dict)

    def origin(self, key_path: str) -> str:
        """The file that set ``key_path`` or its closest parent; the recipe file when unknown."""
        return origin_of(self.origins, key_path, self.source)


def origin_of(origins: dict[str, str], key_path: str, default: str) -> str:
    """The file (or ``command line``) ``origins`` records for ``key_path`` or its closest parent, else ``default``."""
    parts = key_path.split(".") if key_path else []
    while parts:
        found = origins.get(".".join(parts))
        if found:
            return found
        parts.pop()
    return default


def _read_yaml(path: Path, label: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError([RecipeIssue(label, "", f"not valid YAML: {exc}")]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError([RecipeIssue(label, "", f"a recipe must be a mapping of sections ({', '.join(SECTIONS)}), "
                                       f"got {type(data).__name__}")])
    return data


def _record(origins: dict[str, str], value: Any, prefix: str, label: str) -> None:
    origins[prefix] = label
    if isinstance(value, dict):
        for key, sub in value.items():
            _record(origins, sub, f"{prefix}.{key}", label)


def deep_merge(base: dict, override: dict, origins: dict[str, str] | None = None, label: str = "",
               prefix: str = "") -> dict:
    """``override`` merged into a copy of ``base``: mappings merge key by key, anything else replaces.

    A ``null`` in ``override`` replaces too (that is how a child recipe removes a parent's section).
    """
    merged = copy.deepcopy(base)
    for key, value in override.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value, origins, label, path + ".")
        else:
            merged[key] = copy.deepcopy(value)
            if origins is not None:
                _record(origins, value, path, label)
    return merged


def load_raw(name_or_path: str | Path, _chain: tuple[Path, ...] = ()) -> RawRecipe:
    """Read a recipe and everything it ``extends`` (a path relative to the file, or a bundled name)."""
    path = find_recipe(name_or_path, _chain[-1].parent if _chain else None)
    label = display_path(path)
    if path.resolve() in _chain:
        cycle = " -> ".join(display_path(p) for p in (*_chain, path.resolve()))
        raise RecipeError([RecipeIssue(label, "extends", f"circular extends: {cycle}")])
    data = _read_yaml(path, label)
    parent_name = data.pop("extends", None)
    if parent_name is None:
        origins: dict[str, str] = {}
        for key, value in data.items():
            _record(origins, value, key, label)
        return RawRecipe(data, label, origins)
    if not isinstance(parent_name, str):
        raise RecipeError([RecipeIssue(label, "extends", f"must be a file name or bundled recipe name, "
                                       f"got {parent_name!r}")])
    try:
        parent_path = find_recipe(parent_name, path.parent)
    except RecipeError:  # name the file and key that hold the typo, not just the missing name
        where = display_path(path.parent / parent_name)
        raise RecipeError([RecipeIssue(label, "extends", f"{parent_name!r} is neither a file ({where}) nor a bundled "
                                       f"recipe{_bundled_hint(_stem(parent_name))} (`hf-optim ls` lists the bundled "
                                       "ones)")]) from None
    parent = load_raw(parent_path, (*_chain, path.resolve()))
    origins = dict(parent.origins)
    merged = deep_merge(parent.data, data, origins, label)
    return RawRecipe(merged, label, origins)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"training.optim=lamb_8bit"`` -> (``["training", "optim"]``, ``"lamb_8bit"``); the value is read as a
    YAML scalar or flow collection (``2e-4`` and ``1.0e-4`` are floats, ``[q_proj, v_proj]`` a list, ``null``
    None)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise RecipeError([RecipeIssue(COMMAND_LINE, text, "an override is KEY.PATH=VALUE, "
                                       "e.g. training.optim=lamb_8bit")])
    return key.strip().split("."), parse_value(value)


def parse_value(text: str) -> Any:
    """A command-line value as YAML reads it, with ``1e-4``-style numbers read as floats (YAML 1.1 would keep
    them as strings)."""
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text
    return _float_or_same(value)


def _float_or_same(value: Any) -> Any:
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        if value.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
            return number
    return value


def apply_overrides(raw: RawRecipe, overrides: list[str]) -> RawRecipe:
    """``raw`` with each ``KEY.PATH=VALUE`` applied in order (later ones win)."""
    data = copy.deepcopy(raw.data)
    origins = dict(raw.origins)
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for depth, key in enumerate(keys[:-1]):
            if not isinstance(node.get(key), dict):
                if node.get(key) is not None:
                    where = ".".join(keys[: depth + 1])
                    raise RecipeError([RecipeIssue(COMMAND_LINE, text, f"{where} is not a mapping")])
                node[key] = {}
                origins[".".join(keys[: depth + 1])] = COMMAND_LINE  # a section the override created is its own
            node = node[key]
        node[keys[-1]] = value
        _record(origins, value, ".".join(keys), COMMAND_LINE)
    return RawRecipe(data, raw.source, origins)
