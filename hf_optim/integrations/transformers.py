"""Make ``TrainingArguments(optim=...)`` (and TRL's configs, parsers and trainers) build hf_optim's optimizers.

transformers has no optimizer registry, so ``import hf_optim`` does three small, reversible things (see
``../shared/spec/integration.md`` for why each is needed):

1. adds hf_optim's new names (``lamb_8bit``, ...) to ``transformers.training_args.OptimizerNames``, makes those
   members pickle as plain strings (a ``training_args.bin`` then loads where hf_optim was never imported), and
   makes an unknown name fail with the closest valid names from transformers and hf_optim;
2. wraps ``Trainer.get_optimizer_cls_and_kwargs`` so hf_optim's names resolve to hf_optim classes (everything
   else falls through unchanged), and ``Trainer.create_scheduler`` so ``Adafactor(relative_step=True)`` gets the
   scheduler that reports its own step size;
3. updates the ``--optim`` choices of argument parsers built before the import, and says so.

Each step runs when the transformers module it patches is imported (or at once, if it already is), so importing
hf_optim does not import transformers.

Opt-outs: ``HF_OPTIM_TAKEOVER=0`` (or :func:`set_takeover`) leaves transformers' own bitsandbytes-backed names and
``adafactor`` to transformers; hf_optim's added names still work. ``HF_OPTIM_PATCH=0`` patches nothing: use
:class:`HfOptimTrainerMixin` or ``Trainer(optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args, name=...))``.
"""

from __future__ import annotations

import enum
import gc
import importlib.abc
import logging
import os
import sys
import warnings
from typing import Any

import torch
from torch import nn

from hf_optim.integrations.deepspeed import check_under_deepspeed, zero_state_note
from hf_optim.integrations.names import OPTIMIZER_NAMES, OptimizerName, suggest
from hf_optim.integrations.optim_args import parse_optim_args, typed_optim_args
from hf_optim.kernels import backend as kernel_backend
from hf_optim.optim import registry
from hf_optim.optim.adafactor import Adafactor, RelativeStepSchedule
from hf_optim.optim.base import PARAM_OVERRIDES_ATTR
from hf_optim.optim.trainer_mapping import mapping

logger = logging.getLogger("hf_optim")

TAKEOVER_ENV = "HF_OPTIM_TAKEOVER"
PATCH_ENV = "HF_OPTIM_PATCH"

_state = {"takeover": os.environ.get(TAKEOVER_ENV, "1") != "0"}


def set_takeover(enabled: bool) -> None:
    """Whether hf_optim builds the optimizers for transformers' own bitsandbytes names and ``adafactor``."""
    _state["takeover"] = bool(enabled)


def takeover_enabled() -> bool:
    return _state["takeover"]


def handles(name: Any) -> bool:
    """True if the Trainer's ``optim`` value ``name`` is built by hf_optim under the current settings."""
    entry = OPTIMIZER_NAMES.get(_name_str(name))
    return entry is not None and (not entry.takes_over or takeover_enabled())


def _name_str(name: Any) -> str:
    return str(getattr(name, "value", name))


# ------------------------------------------------------------------------------------------------------------
# Resolving a name into (class, kwargs)
def optimizer_kwargs(entry: OptimizerName, args: Any) -> dict[str, Any]:
    """Constructor kwargs for ``entry`` from ``TrainingArguments``, as its algorithm's Trainer mapping says
    (``Algorithm.trainer``: the Trainer's lr, betas and eps as it passes them to bitsandbytes for the same name),
    then ``optim_args`` on top. Weight decay comes in the param groups."""
    extra = typed_optim_args(entry, parse_optim_args(getattr(args, "optim_args", None)))
    betas = [extra.pop(key, None) for key in ("beta1", "beta2", "beta3")]
    return mapping(entry.algorithm).kwargs(args, betas, extra, entry.state_format)


def keep_embeddings_32bit(model: nn.Module) -> int:
    """Mark every ``nn.Embedding`` weight to keep 32-bit state under an 8-bit optimizer (as the Trainer does for
    bitsandbytes); returns the number of marked elements that are trained (frozen ones, as under LoRA, keep no
    state at all, so the log line does not count them)."""
    marked = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            setattr(module.weight, PARAM_OVERRIDES_ATTR, {"optim_bits": 32})
            if module.weight.requires_grad:
                marked[id(module.weight)] = module.weight.numel()
    return sum(marked.values())


def optimizer_cls_and_kwargs(args: Any, model: nn.Module | None = None, name: str | None = None) -> tuple[type, dict]:
    """(class, kwargs) for hf_optim name ``name`` (default ``args.optim``), as the Trainer needs them.

    Usable without any patching: ``Trainer(..., optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args,
    model, name="lamb_8bit"))``. With ``model``, embedding weights keep 32-bit state under 8-bit and 4-bit names
    (the Trainer does this for bitsandbytes' 8-bit names: embedding rows see sparse, spiky gradients).
    """
    name = _name_str(args.optim if name is None else name)
    entry = OPTIMIZER_NAMES.get(name)
    if entry is None:
        raise ValueError(unknown_name_message(name))
    kwargs = optimizer_kwargs(entry, args)
    check_under_deepspeed(entry.class_label, entry.algorithm, entry.state_format, args)
    if kwargs.get("release_gradients"):
        check_release_arguments(args)
    partition = entry.algorithm.partition  # a hybrid: mark which rule each parameter takes
    if model is not None and partition is not None:
        split = partition.mark_model(model, kwargs)
        logger.info("optim=%r routes %s", name, split.describe())
        warning = split.warning()
        if warning:
            logger.warning("optim=%r: %s", name, warning)
    zero_note = zero_state_note(entry.state_format, args)
    if zero_note:
        logger.info("%s", zero_note)
    elif model is not None and entry.state_format.quantized:
        skipped = keep_embeddings_32bit(model)
        if skipped:
            logger.info("%d embedding parameters keep 32-bit state", skipped)  # the handler adds "[hf_optim]"
    logger.info("optim=%r -> %s", name, entry.describe(_backend_label(model)))
    return entry.cls, kwargs


def release_argument_problems(args: Any) -> list[str]:
    """What in ``TrainingArguments`` gradient release cannot honour (empty when it can run).

    Each hook applies and frees its gradient during backward, so nothing that needs all gradients before the step
    can see them: accumulation over micro-batches, global-norm clipping, fp16's GradScaler (unscale and inf check),
    and the distributed backends, whose reduction completes after the hooks fire."""
    problems = []
    accumulation = getattr(args, "gradient_accumulation_steps", 1) or 1
    if accumulation > 1:
        problems.append(
            f"gradient_accumulation_steps={accumulation}: each micro-batch's gradient would be applied on its own "
            "(and the next one refused). Set gradient_accumulation_steps=1 and raise per_device_train_batch_size"
        )
    max_grad_norm = getattr(args, "max_grad_norm", 0) or 0
    if max_grad_norm > 0:
        problems.append(
            f"max_grad_norm={max_grad_norm}: clipping to a global norm needs every gradient before the first "
            "parameter steps, and released gradients are gone by then. Set max_grad_norm=0 (no clipping; the "
            "logged grad_norm is still the norm of the released gradients)"
        )
    if getattr(args, "fp16", False):
        problems.append(
            "fp16=True: the GradScaler unscales gradients and skips steps with inf/NaN after backward, but the hooks "
            "step on the scaled gradients during backward. Use bf16=True (no scaler) or fp32"
        )
    distributed = []
    if getattr(args, "fsdp", None):
        distributed.append(f"fsdp={args.fsdp!r}")
    if getattr(args, "deepspeed", None):
        distributed.append("deepspeed")
    world_size = getattr(args, "world_size", 1)
    if isinstance(world_size, int) and world_size > 1:
        distributed.append(f"{world_size} processes")
    if distributed:
        problems.append(
            f"distributed training ({', '.join(distributed)}): DDP's all-reduce and FSDP2's reduce-scatter produce "
            "the averaged gradient after the hooks have fired. Train on one process, or turn release_gradients off"
        )
    return problems


def check_release_arguments(args: Any) -> None:
    """Raise ``ValueError`` naming every Trainer argument that gradient release cannot honour."""
    problems = release_argument_problems(args)
    if problems:
        raise ValueError(
            "release_gradients=True (optim_args) cannot run with these TrainingArguments:\n- "
            + "\n- ".join(problems)
        )


def _backend_label(model: nn.Module | None) -> str:
    """The kernels the optimizer will run on the model's devices (the Trainer's default device without one):
    ``triton``, ``torch`` or ``torch-compile on CPU`` / ``on CUDA`` (see ``hf_optim.kernels.backend``)."""
    if model is not None:
        devices = {p.device for p in model.parameters()}
    else:
        devices = {torch.device("cuda" if torch.cuda.is_available() else "cpu")}
    label = kernel_backend.describe(devices)
    return label + " on " + "/".join(sorted({d.type.upper() for d in devices})) if label == "torch-compile" else label


def unknown_name_message(name: str) -> str:
    transformers_names = _transformers_names()
    candidates = sorted(set(transformers_names) | set(OPTIMIZER_NAMES))
    close = suggest(name, candidates)
    hint = ", ".join(f"{n!r} ({_origin(n)})" for n in close) if close else "no close match"
    return (
        f"{name!r} is not a valid optimizer name. Did you mean: {hint}? "
        "hf_optim.available_optimizers() lists hf_optim's names; transformers' are in "
        "transformers.training_args.OptimizerNames. (Import hf_optim before building TrainingArguments, "
        "SFTConfig or an argument parser, or its names are unknown.)"
    )


def _origin(name: str) -> str:
    entry = OPTIMIZER_NAMES.get(name)
    if entry is None:
        return "transformers"
    if not entry.takes_over:
        return "hf_optim"
    return "transformers name, built by hf_optim" if takeover_enabled() else "transformers name, bitsandbytes"


def _transformers_names() -> list[str]:
    module = sys.modules.get("transformers.training_args")
    if module is None:
        return []
    return [member.value for member in module.OptimizerNames]


# ------------------------------------------------------------------------------------------------------------
# Patching transformers
def _add_enum_members(enum_cls: type[enum.Enum]) -> None:
    """Add hf_optim's new names to transformers' ``OptimizerNames``, pickling as plain strings."""
    for entry in OPTIMIZER_NAMES.values():
        if entry.name in enum_cls._value2member_map_:
            continue
        member = str.__new__(enum_cls, entry.name)
        member._name_ = entry.name.upper()
        member._value_ = entry.name
        member.__objclass__ = enum_cls
        # An added member must not need hf_optim to unpickle: reduce it to the plain string.
        member.__reduce_ex__ = lambda protocol, value=entry.name: (str, (value,))
        enum_cls._member_map_[member._name_] = member
        enum_cls._value2member_map_[entry.name] = member
        enum_cls._member_names_.append(member._name_)

    def _missing_(cls, value):
        raise ValueError(unknown_name_message(str(value)))

    enum_cls._missing_ = classmethod(_missing_)


def _patch_training_args(module) -> None:
    _add_enum_members(module.OptimizerNames)
    _update_existing_parsers()


def _patch_trainer(module) -> None:
    trainer_cls = module.Trainer
    original = trainer_cls.__dict__["get_optimizer_cls_and_kwargs"]
    if getattr(original, "__hf_optim__", False):
        return
    original_fn = original.__func__ if isinstance(original, staticmethod) else original

    def get_optimizer_cls_and_kwargs(args, model=None):
        if handles(args.optim):
            return optimizer_cls_and_kwargs(args, model)
        return original_fn(args, model)

    get_optimizer_cls_and_kwargs.__hf_optim__ = True
    get_optimizer_cls_and_kwargs.__wrapped__ = original_fn
    get_optimizer_cls_and_kwargs.__doc__ = original_fn.__doc__
    trainer_cls.get_optimizer_cls_and_kwargs = staticmethod(get_optimizer_cls_and_kwargs)
    _patch_create_scheduler(trainer_cls)
    _patch_grad_norm(trainer_cls)


def _patch_create_scheduler(trainer_cls) -> None:
    """``Adafactor(relative_step=True)`` computes its own step size and holds no lr for the Trainer's schedulers
    to scale: give it :class:`RelativeStepSchedule` (what transformers' ``AdafactorSchedule`` is for)."""
    original = trainer_cls.create_scheduler
    if getattr(original, "__hf_optim__", False):
        return

    def create_scheduler(self, num_training_steps, optimizer=None):
        inner = optimizer if optimizer is not None else self.optimizer
        inner = getattr(inner, "optimizer", inner)  # accelerate's wrapper
        if getattr(inner, "release_gradients", False):  # also an optimizer the user built and passed in
            check_release_arguments(self.args)
        if self.lr_scheduler is None and isinstance(inner, Adafactor) and inner.param_groups[0]["relative_step"]:
            logger.info("Adafactor(relative_step=True) sets its own step size: lr_scheduler_type=%r is not used",
                        str(getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)))
            self.lr_scheduler = RelativeStepSchedule(inner)
            return self.lr_scheduler
        return original(self, num_training_steps, optimizer)

    create_scheduler.__hf_optim__ = True
    create_scheduler.__wrapped__ = original
    trainer_cls.create_scheduler = create_scheduler


def _patch_grad_norm(trainer_cls) -> None:
    """With gradient release the Trainer finds no gradients to measure (it would log a grad_norm of 0): report the
    norm of the gradients the optimizer released during this step's backward instead."""
    original = getattr(trainer_cls, "_get_grad_norm", None)
    if original is None or getattr(original, "__hf_optim__", False):
        return

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
            released = getattr(inner, "released_grad_norm", None)
            if released is not None:
                return released
        return original(self, model, grad_norm=grad_norm)

    _get_grad_norm.__hf_optim__ = True
    _get_grad_norm.__wrapped__ = original
    trainer_cls._get_grad_norm = _get_grad_norm


def _update_existing_parsers(warn: bool = True) -> None:
    """Parsers built before ``import hf_optim`` froze the ``--optim`` choices: add hf_optim's names and warn
    (``warn=False``: names of an algorithm registered later, which no parser could have known)."""
    module = sys.modules.get("transformers.hf_argparser")
    if module is None:
        return
    stale = 0
    for obj in gc.get_objects():
        if issubclass(type(obj), module.HfArgumentParser):  # type(): no __class__ property side effects
            for action in obj._actions:
                if "--optim" in action.option_strings and action.choices is not None:
                    missing = [n for n in OPTIMIZER_NAMES if n not in action.choices]
                    if missing:
                        stale += 1
                        # The parser's type function passes unknown strings through; only the choices need the names.
                        action.choices = list(action.choices) + missing
    if stale and warn:
        warnings.warn(
            f"{stale} argument parser(s) were built before `import hf_optim`; their --optim choices were updated. "
            "Import hf_optim before building TrainingArguments, SFTConfig or their parsers.",
            stacklevel=3,
        )


class _PostImportHook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Run a function on a module right after it is first imported (the module is not imported here)."""

    def __init__(self, hooks: dict[str, Any]):
        self.hooks = hooks
        self._loaders: dict[str, Any] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.hooks:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None:
            return None
        self._loaders[fullname] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module):
        self._loaders[module.__name__].exec_module(module)
        self.hooks.pop(module.__name__)(module)


def _rank_zero_info(record: logging.LogRecord) -> bool:
    """Under a multi-process launch every rank builds the same optimizer and runs the same recipe: hf_optim's INFO
    lines show on rank 0 only (warnings and errors on every rank, where they may differ). A filter of the logger,
    not of a handler: ``hf-optim train`` swaps the handlers for ones that write above the progress bar."""
    return record.levelno >= logging.WARNING or os.environ.get("RANK", "0").strip() in ("", "0")


def _ensure_log_handler() -> None:
    """Show hf_optim's INFO lines (the one line per optimizer creation) unless the user configured the logger."""
    if _rank_zero_info not in logger.filters:
        logger.addFilter(_rank_zero_info)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[hf_optim] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _add_registered_names(family) -> None:
    """An algorithm registered after transformers' training arguments were imported: add its names there too."""
    module = sys.modules.get("transformers.training_args")
    if module is not None:
        _add_enum_members(module.OptimizerNames)
        _update_existing_parsers(warn=False)


def install() -> None:
    """Patch transformers now (modules already imported) or when it is imported. Idempotent."""
    if os.environ.get(PATCH_ENV, "1") == "0":
        return
    if not _state.get("subscribed"):
        registry.on_register(_add_registered_names)
        _state["subscribed"] = True
    _ensure_log_handler()
    hooks = {"transformers.training_args": _patch_training_args, "transformers.trainer": _patch_trainer}
    pending = {}
    for name, hook in hooks.items():
        if name in sys.modules:
            hook(sys.modules[name])
        else:
            pending[name] = hook
    if pending and not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook(pending))


class HfOptimTrainerMixin:
    """Resolve hf_optim names in a Trainer without patching transformers (works with ``HF_OPTIM_PATCH=0``).

    ``class MyTrainer(HfOptimTrainerMixin, SFTTrainer): hf_optim_name = "lamb_8bit"``. Without
    ``hf_optim_name``, ``args.optim`` is used when it is one of hf_optim's names (e.g. ``paged_adamw_8bit``).
    """

    hf_optim_name: str | None = None

    def create_optimizer(self, *args, **kwargs):
        name = self.hf_optim_name or _name_str(self.args.optim)
        if getattr(self, "optimizer", None) is None and name in OPTIMIZER_NAMES:
            # An instance attribute shadows the Trainer's staticmethod, in every transformers version.
            self.get_optimizer_cls_and_kwargs = lambda a, model=None: optimizer_cls_and_kwargs(a, model, name=name)
        return super().create_optimizer(*args, **kwargs)
