"""Reading recipe files: YAML, ``extends:`` (deep merge), dotted command-line overrides, and bundled recipes.

Every leaf value remembers the file (or ``command line``) it came from, so errors name the right file. A value
YAML 1.1 reads as a boolean from a word (``no``, ``yes``, ``on``, ``off``, ``y``, ``n``, ``true``, ``false`` in any
of its spellings) also keeps the word as written, so that validation can read it by the field's type: a bool
field takes the boolean, a string or enum field the word (``save_strategy: no`` is transformers' ``"no"``).
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
        bool_words: the word written for each value YAML read as a boolean, by dotted key path (list items by
            index): ``{"training.save_strategy": "no"}``. See :meth:`as_written`.
    """

    data: dict[str, Any]
    source: str
    origins: dict[str, str] = field(default_factory=dict)
    bool_words: dict[str, str] = field(default_factory=dict)

    def origin(self, key_path: str) -> str:
        """The file that set ``key_path`` or its closest parent; the recipe file when unknown."""
        return origin_of(self.origins, key_path, self.source)

    def as_written(self, key_path: str, value: Any) -> Any:
        """``value`` (the one at ``key_path``) with every boolean YAML read from a word, at or below ``key_path``,
        back as the word written (``False`` -> ``"no"``); None when there is no such boolean there. Validation
        takes it where the field's type refuses the boolean and accepts the word (a string or an enum)."""
        below = {rel: word for path, word in self.bool_words.items()
                 if (rel := _relative(path, key_path)) is not None}
        return _with_words(value, below) if below else None


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _relative(path: str, prefix: str) -> str | None:
    """``path`` below ``prefix`` (``""`` for ``prefix`` itself); None when it is not at or below it."""
    if path == prefix:
        return ""
    return path[len(prefix) + 1:] if path.startswith(prefix + ".") else None


def _with_words(value: Any, words: dict[str, str]) -> Any:
    """A copy of ``value`` with the booleans at ``words``' relative paths replaced by their words; a path that no
    longer leads to a boolean (a later file or override put something else there) is left alone."""
    if "" in words:
        return words[""] if isinstance(value, bool) else value
    if isinstance(value, dict):
        return {key: _with_words(item, _below(words, str(key))) for key, item in value.items()}
    if isinstance(value, list):
        return [_with_words(item, _below(words, str(index))) for index, item in enumerate(value)]
    return value


def _below(words: dict[str, str], key: str) -> dict[str, str]:
    return {rel: word for path, word in words.items() if (rel := _relative(path, key)) is not None}


def _replace_words(words: dict[str, str], key_path: str, new: dict[str, str]) -> None:
    """A value was set at ``key_path``: forget the words recorded at or below it, and add ``new``'s (their paths
    relative to ``key_path``)."""
    for path in [p for p in words if _relative(p, key_path) is not None]:
        del words[path]
    words.update({(_join(key_path, rel) if rel else key_path): word for rel, word in new.items()})


_BOOL_TAG = "tag:yaml.org,2002:bool"


def _bool_words(node: yaml.Node | None, prefix: str = "") -> dict[str, str]:
    """The word of each scalar the YAML loader resolved as a boolean, by dotted path under ``prefix``."""
    if isinstance(node, yaml.ScalarNode):
        return {prefix: node.value} if node.tag == _BOOL_TAG else {}
    found: dict[str, str] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                found.update(_bool_words(value, _join(prefix, key.value)))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found.update(_bool_words(item, _join(prefix, index)))
    return found


def read_yaml(text: str) -> tuple[Any, dict[str, str]]:
    """``text`` as ``yaml.safe_load`` reads it, and the words it read as booleans (see :class:`RawRecipe`), by
    dotted path (``""``: the document itself is one)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    return data, _bool_words(node)


def origin_of(origins: dict[str, str], key_path: str, default: str) -> str:
    """The file (or ``command line``) ``origins`` records for ``key_path`` or its closest parent, else ``default``."""
    parts = key_path.split(".") if key_path else []
    while parts:
        found = origins.get(".".join(parts))
        if found:
            return found
        parts.pop()
    return default


def _read_yaml(path: Path, label: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The file's mapping and its boolean words (:func:`read_yaml`)."""
    try:
        data, words = read_yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError([RecipeIssue(label, "", f"not valid YAML: {exc}")]) from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise RecipeError([RecipeIssue(label, "", f"a recipe must be a mapping of sections ({', '.join(SECTIONS)}), "
                                       f"got {type(data).__name__}")])
    return data, words


def _record(origins: dict[str, str], value: Any, prefix: str, label: str) -> None:
    origins[prefix] = label
    if isinstance(value, dict):
        for key, sub in value.items():
            _record(origins, sub, f"{prefix}.{key}", label)


def deep_merge(base: dict, override: dict, origins: dict[str, str] | None = None, label: str = "",
               prefix: str = "", replaced: list[str] | None = None) -> dict:
    """``override`` merged into a copy of ``base``: mappings merge key by key, anything else replaces.

    A ``null`` in ``override`` replaces too (that is how a child recipe removes a parent's section). ``replaced``,
    when given, collects the dotted paths where a value of ``override`` replaced ``base``'s.
    """
    merged = copy.deepcopy(base)
    for key, value in override.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value, origins, label, path + ".", replaced)
        else:
            merged[key] = copy.deepcopy(value)
            if origins is not None:
                _record(origins, value, path, label)
            if replaced is not None:
                replaced.append(path)
    return merged


def load_raw(name_or_path: str | Path, _chain: tuple[Path, ...] = ()) -> RawRecipe:
    """Read a recipe and everything it ``extends`` (a path relative to the file, or a bundled name)."""
    path = find_recipe(name_or_path, _chain[-1].parent if _chain else None)
    label = display_path(path)
    if path.resolve() in _chain:
        cycle = " -> ".join(display_path(p) for p in (*_chain, path.resolve()))
        raise RecipeError([RecipeIssue(label, "extends", f"circular extends: {cycle}")])
    data, words = _read_yaml(path, label)
    parent_name = data.pop("extends", None)
    _replace_words(words, "extends", {})
    if parent_name is None:
        origins: dict[str, str] = {}
        for key, value in data.items():
            _record(origins, value, key, label)
        return RawRecipe(data, label, origins, words)
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
    origins, replaced = dict(parent.origins), []
    merged = deep_merge(parent.data, data, origins, label, replaced=replaced)
    merged_words = dict(parent.bool_words)
    for key_path in replaced:
        _replace_words(merged_words, key_path, {})
    merged_words.update(words)
    return RawRecipe(merged, label, origins, merged_words)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"training.optim=lamb_8bit"`` -> (``["training", "optim"]``, ``"lamb_8bit"``); the value is read as a
    YAML scalar or flow collection (``2e-4`` and ``1.0e-4`` are floats, ``[q_proj, v_proj]`` a list, ``null``
    None; ``no`` a boolean, which validation reads back as the word for a string or enum field)."""
    keys, value, _ = _parse_override(text)
    return keys, value


def _parse_override(text: str) -> tuple[list[str], Any, dict[str, str]]:
    """(key path, value, the value's boolean words by path relative to it)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise RecipeError([RecipeIssue(COMMAND_LINE, text, "an override is KEY.PATH=VALUE, "
                                       "e.g. training.optim=lamb_8bit")])
    parsed, words = _parse_value(value)
    return key.strip().split("."), parsed, words


def parse_value(text: str) -> Any:
    """A command-line value as YAML reads it, with ``1e-4``-style numbers read as floats (YAML 1.1 would keep
    them as strings)."""
    return _parse_value(text)[0]


def _parse_value(text: str) -> tuple[Any, dict[str, str]]:
    try:
        value, words = read_yaml(text) if text.strip() else ("", {})
    except yaml.YAMLError:
        return text, {}
    return _float_or_same(value), words


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
    origins, words = dict(raw.origins), dict(raw.bool_words)
    for text in overrides:
        keys, value, value_words = _parse_override(text)
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
        _replace_words(words, ".".join(keys), value_words)
    return RawRecipe(data, raw.source, origins, words)
