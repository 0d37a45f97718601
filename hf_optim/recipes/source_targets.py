"""What each pass-through section accepts, read from the installed source files without importing them.

:mod:`hf_optim.recipes.targets` reads these facts from the imported classes; importing them takes seconds (torch,
transformers, TRL). The quick check (:mod:`hf_optim.recipes.quickcheck`) reads the same classes' source with
``ast``: the dataclass fields of ``SFTConfig`` and ``LoraConfig`` (and of their dataclass bases), the parameters of
``BitsAndBytesConfig.__init__`` and of ``PreTrainedModel.from_pretrained`` (with the keyword arguments its body
pops), and the fields documented as deprecated aliases.

A field's type is its annotation as written, evaluated with the names its module imports from ``typing``; any other
name (a class of the package, ``torch.dtype``, ``os.PathLike``) becomes :class:`Opaque`, which pydantic validates as
matching nothing. So a value that passes is valid for the real type too (the real type can only accept more),
and one that does not is left to the full check. Anything this reader does not follow (a base class it cannot
find, ``ClassVar``, a default or help text that is not a literal) makes the target None or the field
:data:`~hf_optim.recipes.checks.UNREAD`, and the quick check leaves the recipe to the full one.

Standard library only (pydantic when a value is checked against :class:`Opaque`). ``tests/cli/test_cli_fast.py``
compares every target with the installed one.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import re
import typing
from collections.abc import Collection
from pathlib import Path
from typing import Any

from hf_optim.recipes.targets import _ALIAS_HELP, UNREAD, Target

_DEFINED_IN = {("transformers", "TrainingArguments"): "transformers.training_args"}
"""Where a class that a lazily-importing package (transformers) re-exports is defined, for :func:`_class_node`."""


def _module_file(module: str) -> Path | None:
    """The source file of ``module`` without importing it (or its package's ``__init__``); None if not found."""
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations)))
    path = base.joinpath(*rest.split(".")) if rest else base
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _module_source(module: str) -> tuple[str, ast.Module] | None:
    path = _module_file(module)
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
        return text, ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return None


def module_tree(module: str) -> ast.Module | None:
    """The parsed source of ``module``, or None when it cannot be found or read."""
    found = _module_source(module)
    return found[1] if found else None


def _class_node(module: str, name: str) -> tuple[str, ast.ClassDef] | None:
    """(module that defines it, its ``class`` statement) for class ``name`` as ``module`` sees it."""
    module = _DEFINED_IN.get((module, name), module)
    tree = module_tree(module)
    if tree is None:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    for node in tree.body:  # imported into module: follow `from X import name`
        if isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname is None for a in node.names):
            package = module if _module_file(module) and _module_file(module).name == "__init__.py" \
                else module.rpartition(".")[0]
            for _ in range(max(node.level - 1, 0)):
                package = package.rpartition(".")[0]
            source = node.module or ""
            target = (f"{package}.{source}" if source else package) if node.level else source
            return _class_node(target, name) if target and target != module else None
    return None


# -- evaluating an annotation --------------------------------------------------------------------------------------

def _refuse(value: Any) -> Any:
    from pydantic_core import PydanticCustomError

    raise PydanticCustomError("opaque", "a type read from source only")


class _OpaqueType(type):
    def __getattr__(cls, name: str) -> Any:  # ``torch.dtype``: a name of a module the source imports
        if name.startswith("_"):
            raise AttributeError(name)
        return Opaque

    def __getitem__(cls, item: Any) -> Any:  # ``SomeGeneric[int]``
        return Opaque


class Opaque(metaclass=_OpaqueType):
    """A name of an annotation that is not ``typing``'s or a builtin: matches no value (see the module docstring)."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_plain_validator_function(_refuse)


@functools.cache
def _typing_names(module: str) -> dict[str, Any]:
    """The names ``module`` binds to ``typing`` or its members (``from typing import Optional``, ``import typing as
    t``)."""
    names: dict[str, Any] = {}
    for node in (module_tree(module) or ast.Module(body=[], type_ignores=[])).body:
        if isinstance(node, ast.ImportFrom) and node.module == "typing" and not node.level:
            for alias in node.names:
                if hasattr(typing, alias.name):
                    names[alias.asname or alias.name] = getattr(typing, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "typing":
                    names[alias.asname or "typing"] = typing
    return names


def _value(node: ast.expr, names: dict[str, Any], literal: bool = False) -> Any:
    """What ``node``, an annotation or part of one, names. Only what annotations are made of is followed (names,
    attributes, subscripts, ``|``, tuples and lists of them, constants); a quoted part (``Optional["Tokenizer"]``)
    is read as the expression it quotes, except ``Literal``'s strings (``literal``)."""
    if isinstance(node, ast.Name):
        return names[node.id] if node.id in names else getattr(builtins, node.id, Opaque)
    if isinstance(node, ast.Attribute):
        return getattr(_value(node.value, names), node.attr)
    if isinstance(node, ast.Subscript):
        origin = _value(node.value, names)
        return origin[_value(node.slice, names, literal=origin is typing.Literal)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _value(node.left, names) | _value(node.right, names)
    if isinstance(node, ast.Tuple):
        return tuple(_value(item, names, literal) for item in node.elts)
    if isinstance(node, ast.List):
        return [_value(item, names, literal) for item in node.elts]
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str) and not literal:
            return _value(ast.parse(node.value, mode="eval").body, names)
        return node.value
    raise ValueError(f"not followed in an annotation: {ast.dump(node)}")


def evaluate(annotation: ast.expr, module: str) -> Any:
    """The type ``annotation`` (in ``module``'s source) names, with :class:`Opaque` for what is not ``typing``'s or a
    builtin; :data:`UNREAD` when it cannot be evaluated."""
    try:
        return _value(annotation, _typing_names(module))
    except Exception:  # anything this reader does not follow
        return UNREAD


# -- dataclass fields and signatures ------------------------------------------------------------------------------

def _is_dataclass(node: ast.ClassDef) -> bool:
    return any(isinstance(d, ast.Name | ast.Call | ast.Attribute) and ast.unparse(d).split("(")[0].split(".")[-1]
               == "dataclass" for d in node.decorator_list)


def _field_call(value: ast.expr | None) -> ast.Call | None:
    if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "field":
        return value
    return None


def _help(call: ast.Call | None) -> str | None:
    """The ``help`` of a ``field(metadata={...})``: "" when there is none, None when it is not a literal."""
    metadata = next((k.value for k in call.keywords if k.arg == "metadata"), None) if call else None
    if metadata is None:
        return ""
    try:
        value = ast.literal_eval(metadata)
    except ValueError:
        return None
    return str(value.get("help", "")) if isinstance(value, dict) else None


@functools.cache
def dataclass_fields(module: str, name: str) -> tuple[dict[str, Any], dict[str, list[str | None]]] | None:
    """(``__init__`` field -> type, field -> the help texts its classes give it) of class ``name`` of ``module``,
    bases first as ``dataclasses`` collects them; None when the chain is not one this reader follows."""
    found = _class_node(module, name)
    if found is None:
        return None
    where, node = found
    fields: dict[str, Any] = {}
    helps: dict[str, list[str | None]] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id == "object":
            continue
        if not isinstance(base, ast.Name):
            return None
        inherited = dataclass_fields(where, base.id)
        if inherited is None:
            return None
        fields.update(inherited[0])
        for key, texts in inherited[1].items():
            helps.setdefault(key, []).extend(texts)
    if not _is_dataclass(node):
        return fields, helps  # a plain class adds no fields, and passes its bases' on
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        text = ast.unparse(statement.annotation)
        if "ClassVar" in text or "InitVar" in text:
            return None
        call = _field_call(statement.value)
        init = next((k.value for k in call.keywords if k.arg == "init"), None) if call else None
        key = statement.target.id
        if init is not None:
            if not (isinstance(init, ast.Constant) and init.value is False):
                return None
            fields.pop(key, None)  # not an __init__ argument
            continue
        fields[key] = evaluate(statement.annotation, where)
        helps.setdefault(key, []).append(_help(call))
    return fields, helps


def _default_type(default: ast.expr) -> Any:
    """What :func:`hf_optim.recipes.targets._signature_fields` makes of an unannotated parameter's default."""
    try:
        value = ast.literal_eval(default)
    except ValueError:
        return UNREAD
    return type(value) if type(value) in (bool, int, float, str) else None


def signature_fields(function: ast.FunctionDef, module: str, skip: set[str]) -> dict[str, Any]:
    """Parameters of ``function`` (typed as :func:`hf_optim.recipes.targets._signature_fields` types them)."""
    arguments = function.args
    positional = [*arguments.posonlyargs, *arguments.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    fields = {}
    for argument, default in [*zip(positional, defaults), *zip(arguments.kwonlyargs, arguments.kw_defaults)]:
        if argument.arg in skip:
            continue
        if argument.annotation is not None:
            fields[argument.arg] = evaluate(argument.annotation, module)
        else:
            fields[argument.arg] = None if default is None else _default_type(default)
    return fields


def _method(module: str, cls: str, name: str) -> tuple[str, ast.FunctionDef] | None:
    found = _class_node(module, cls)
    if found is None:
        return None
    where, node = found
    method = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    return (where, method) if method is not None else None


_POPPED = re.compile(r"""kwargs\.pop\(\s*["']([A-Za-z]\w*)["']""")


def model_target() -> Target | None:
    """:func:`hf_optim.recipes.targets.model_target` from source."""
    found = _method("transformers.modeling_utils", "PreTrainedModel", "from_pretrained")
    if found is None:
        return None
    where, function = found
    fields = signature_fields(function, where, {"cls", "pretrained_model_name_or_path", "config"})
    lines = _module_source(where)[0].splitlines()[function.lineno - 1:function.end_lineno]
    text = "\n".join(lines)  # the function's source (ast.get_source_segment is ten times slower)
    for name in sorted(set(_POPPED.findall(text)) - set(fields)):
        fields[name] = None
    fields.pop("quantization_config", None)
    return Target("model", "from_pretrained argument", fields, exact=False)


def quantization_target() -> Target | None:
    """:func:`hf_optim.recipes.targets.quantization_target` from source."""
    found = _method("transformers.utils.quantization_config", "BitsAndBytesConfig", "__init__")
    if found is None:
        return None
    return Target("quantization", "BitsAndBytesConfig field", signature_fields(found[1], found[0], {"self"}),
                  exact=False)


def _dataclass_target(section: str, label: str, module: str, name: str, aliases: bool) -> Target | None:
    found = dataclass_fields(module, name)
    if found is None:
        return None
    fields, helps = found
    known, unread = {}, set()
    for key, texts in helps.items():
        for text in texts:
            if text is None:
                unread.add(key)
            elif (match := _ALIAS_HELP.match(text)) and match.group(1) in fields:
                known[key] = match.group(1)
    return Target(section, label, fields, known if aliases else {}, exact=False,
                  unread_aliases=frozenset(unread - set(known)) if aliases else frozenset())


def peft_target() -> Target | None:
    """:func:`hf_optim.recipes.targets.peft_target` from source."""
    return _dataclass_target("peft", "LoraConfig field", "peft.tuners.lora.config", "LoraConfig", aliases=False)


def training_target() -> Target | None:
    """:func:`hf_optim.recipes.targets.training_target` from source."""
    return _dataclass_target("training", "SFTConfig field", "trl.trainer.sft_config", "SFTConfig", aliases=True)


_READERS = {"model": model_target, "quantization": quantization_target, "peft": peft_target,
            "training": training_target}


@functools.cache
def target(section: str) -> Target | None:
    """The target of ``section`` (``model``, ``quantization``, ``peft``, ``training``) from source, or None when it
    cannot be read."""
    return _READERS[section]()


def pass_through_targets(sections: Collection[str] = tuple(_READERS)) -> dict[str, Target] | None:
    """The targets of ``sections`` from source (the others empty: for a recipe that sets no key of theirs, which
    spares reading their files), or None when one of ``sections`` cannot be read."""
    targets = {}
    for section in _READERS:
        found = target(section) if section in sections else Target(section, "", {}, exact=False)
        if found is None:
            return None
        targets[section] = found
    return targets
