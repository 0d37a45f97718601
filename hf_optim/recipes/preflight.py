"""The checks ``hf-optim train`` runs before it loads a model, shared with ``hf-optim validate``.

:func:`preflight` builds, without weights and without training, what the run builds before its first step and
reports each rejection as one line naming the key and the file (or ``command line``) that set it:

- the environment variables hf_optim reads (``HF_OPTIM_BACKEND``, ``HF_OPTIM_COMPILE``), for a run that steps an
  hf_optim optimizer;
- ``training`` -> ``SFTConfig`` (its own combination checks), with ``auto`` resolved for this machine;
- the optimizer the Trainer would build for ``training.optim``: its class and keyword arguments as the Trainer
  derives them, then the constructor's own checks on two tiny tensors in the Trainer's two weight-decay groups
  (a negative ``training.learning_rate`` is rejected here, named);
- ``peft`` -> ``LoraConfig`` applied to the model built from its config on the meta device (the target modules
  must exist; the adapters' own checks);
- dtype names, a local ``model.id`` or ``data.path`` that does not exist.

:func:`check_model_source` (``train`` only: it may touch the network) makes sure the model can be loaded: a local
directory, the Hugging Face cache, or a reachable Hub; without network it says what to do in one line instead of
a minute of retries and a traceback.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from hf_optim.errors import OFFLINE_HINT
from hf_optim.recipes.blame import blamed, culprit_keys
from hf_optim.recipes.errors import RecipeError, RecipeIssue
from hf_optim.recipes.schema import Recipe

ENVIRONMENT = "environment"
"""How an issue names its source when an environment variable holds the bad value."""

HARDWARE_KEYS = {"bf16": False, "fp16": False, "tf32": None, "bf16_full_eval": False, "fp16_full_eval": False}
"""``training`` keys whose rejection depends on the machine (``bf16: true`` on a CPU), not on the recipe, each with
the value that asks nothing of the hardware (tried instead of removing the key: TRL defaults ``bf16`` to True)."""

DATA_FORMATS = (".jsonl", ".json", ".csv", ".parquet")
"""Local data files ``data.path`` may name (:func:`hf_optim.recipes.build.build_datasets`)."""

# Trainer keyword argument -> the training keys it comes from (optim_args wins where it sets the same argument).
_TRAINER_KWARG_KEYS = {"lr": ("learning_rate",), "betas": ("adam_beta1", "adam_beta2"), "eps": ("adam_epsilon",),
                       "weight_decay": ("weight_decay",)}
_OPTIM_ARGS_ALIASES = {"betas": ("beta1", "beta2", "beta3", "betas"), "eps": ("eps",), "lr": ("lr",)}


def preflight(recipe: Recipe, this_machine: bool = True) -> list[str]:
    """Run every check ``train`` runs before loading the model (see the module docstring).

    Args:
        recipe: a recipe from :func:`hf_optim.recipes.load_recipe` (``auto`` not resolved yet).
        this_machine (bool, default True): whether the recipe must run here. False (``hf-optim validate``, which
            may check a GPU recipe on a laptop): what only this machine cannot do (``training.bf16: true`` on a
            CPU) is returned as a warning instead of raised.

    Returns:
        Warnings that do not stop a run (an optimizer's own warning at construction, e.g. LAMB without weight
        decay), one line each.

    Raises:
        RecipeError: every problem found, each naming the key and the file or ``command line`` that set it.
    """
    from hf_optim.recipes.hardware import resolve_auto

    issues: list[RecipeIssue] = []
    found: list[str] = []
    resolved = resolve_auto(recipe)
    with _quiet():
        _check_dtypes(recipe, issues)
        _check_local_paths(recipe, issues)
        args = _training_arguments(resolved, issues, found, this_machine)
        if args is not None and not _check_environment(recipe, args, issues):
            _check_optimizer(recipe, args, issues, found)
        _check_adapters(recipe, issues)
    if issues:
        raise RecipeError(issues)
    return found


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No log lines from hf_optim (the optimizer's mapping line is the run's to print) and no warnings from the
    classes built here (their deprecations are the run's, shown or hidden by its console)."""
    hf_logger = logging.getLogger("hf_optim")
    level = hf_logger.level
    hf_logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logger.setLevel(level)


def _check_dtypes(recipe: Recipe, issues: list[RecipeIssue]) -> None:
    from hf_optim.recipes.build import torch_dtype

    keyed = [(f"model.{k}", recipe.model.get(k)) for k in ("dtype", "torch_dtype")]
    keyed += [(f"quantization.{k}", (recipe.quantization or {}).get(k))
              for k in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage")]
    for path, value in keyed:
        if value is None:
            continue
        try:
            torch_dtype(value)
        except ValueError as exc:
            issues.append(RecipeIssue(recipe.origin(path), path, str(exc)))


def _looks_local(text: str) -> bool:
    """A path the user means as a local one (a Hub id is ``owner/name``: no leading ``/``, ``.`` or ``~``)."""
    return text.startswith(("/", "./", "../", "~", "\\")) or Path(text).suffix in DATA_FORMATS or \
        (len(text) > 1 and text[1] == ":")  # a Windows drive


def _check_local_paths(recipe: Recipe, issues: list[RecipeIssue]) -> None:
    from hf_optim.tiny import BUILTIN_DATA, BUILTIN_MODEL

    for key in ("id", "tokenizer"):
        value = recipe.model.get(key)
        if isinstance(value, str) and value != BUILTIN_MODEL and _looks_local(value) and \
                not Path(value).expanduser().is_dir():
            issues.append(RecipeIssue(recipe.origin(f"model.{key}"), f"model.{key}",
                                      f"no such directory: {value!r} (a local model is a directory with config.json; "
                                      f"a Hub id is owner/name)"))
    path = recipe.data.path
    if path == BUILTIN_DATA:
        return
    local = Path(path).expanduser()
    if local.is_file() and local.suffix not in DATA_FORMATS:
        issues.append(RecipeIssue(recipe.origin("data.path"), "data.path",
                                  f"{path!r} is a {local.suffix or 'suffix-less'} file; a local data file is one of "
                                  f"{', '.join(DATA_FORMATS)} (or give a directory of them, or a Hub dataset id)"))
    elif not local.exists() and _looks_local(path):
        issues.append(RecipeIssue(recipe.origin("data.path"), "data.path",
                                  f"no such file or directory: {path!r} (a local {'/'.join(DATA_FORMATS)} file, a "
                                  f"directory of them, a Hub dataset id, or builtin:tiny-chat)"))


def _training_arguments(resolved: Recipe, issues: list[RecipeIssue], found: list[str], this_machine: bool):
    """The SFTConfig the run builds, or None when it rejects the recipe's values (an issue naming them)."""
    from hf_optim.recipes.build import build_sft_config
    from hf_optim.recipes.train import default_output_dir

    output_dir = default_output_dir(resolved)
    training = {k: v for k, v in resolved.training.items() if k != "output_dir"}

    def build(values):
        changed = copy.copy(resolved)
        changed.training = dict(values)
        return build_sft_config(changed, output_dir)

    try:
        return build(training)
    except Exception as exc:  # noqa: BLE001 (TrainingArguments' checks raise ValueError, ImportError, ...)
        why = _one_line(exc)
        keys = culprit_keys(build, training, HARDWARE_KEYS)
        unset = [] if keys else _unset_hardware_culprits(build, training)
        file, path = blamed(resolved.origin, "training", keys or unset)
        if unset:  # not in the recipe: the class's default asks for hardware this machine lacks (TRL: bf16=True)
            path += " (not set: SFTConfig's default)"
        if (keys or unset) and set(keys or unset) <= set(HARDWARE_KEYS):
            neutral = {**training, **{key: HARDWARE_KEYS[key] for key in keys or unset}}
            if not this_machine:
                found.append(f"{path}: this machine cannot train it as is ({why})")
                with contextlib.suppress(Exception):
                    return build(neutral)  # go on checking the rest with what this machine can run
                return None
            why += " (this machine's hardware: set it to auto, or run on a machine that supports it)"
        what = "these values" if len(keys) != 1 and not unset else "this value"
        issues.append(RecipeIssue(file, path, f"SFTConfig rejected {what}: {why}"))
        return None


def _unset_hardware_culprits(build, training: dict) -> list[str]:
    """Hardware keys the recipe does not set whose neutral value (``bf16: false``) makes ``build`` succeed."""
    for key, value in HARDWARE_KEYS.items():
        if key in training:
            continue
        try:
            build({**training, key: value})
        except Exception:  # noqa: BLE001
            continue
        return [key]
    return []


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _target_device(args) -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() and not getattr(args, "use_cpu", False) \
        else torch.device("cpu")


def _check_environment(recipe: Recipe, args, issues: list[RecipeIssue]) -> bool:
    """The environment variables hf_optim's optimizers read at their first step; True when one is bad."""
    from hf_optim.integrations.names import OPTIMIZER_NAMES
    from hf_optim.kernels.backend import uses_triton
    from hf_optim.kernels.torch_path.cpu_compile import compile_mode

    if recipe.optim not in OPTIMIZER_NAMES:
        return False
    try:
        uses_triton(_target_device(args))
        compile_mode()  # HF_OPTIM_COMPILE, read at the first step (building the optimizer reads it too)
    except (ValueError, RuntimeError) as exc:
        issues.append(RecipeIssue(ENVIRONMENT, "", str(exc)))
        return True
    return False


def _needs_model(optim: str) -> bool:
    """transformers' optimizers that need the model itself to be built (GaLore, APOLLO, LOMO): not checked here."""
    return any(part in optim for part in ("galore", "apollo", "lomo"))


def _check_optimizer(recipe: Recipe, args, issues: list[RecipeIssue], found: list[str]) -> None:
    """Build the optimizer the Trainer would build, on two tiny tensors in the Trainer's two weight-decay groups."""
    from transformers import Trainer

    optim = recipe.optim
    if _needs_model(optim):
        return
    try:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    except (ValueError, TypeError, ImportError, RuntimeError) as exc:
        from hf_optim.integrations.deepspeed import DeepSpeedConflict

        if isinstance(exc, DeepSpeedConflict):  # the launch's DeepSpeed config against the optimizer or precision
            key = f"training.{exc.setting}"
        else:
            key = "training.optim_args" if recipe.training.get("optim_args") else "training.optim"
        issues.append(RecipeIssue(recipe.origin(key), key, _one_line(exc)))
        return
    device = _target_device(args)

    def groups(weight_decay):
        return [{"params": [torch.zeros(4, 4, device=device, requires_grad=True)], "weight_decay": weight_decay},
                {"params": [torch.zeros(4, device=device, requires_grad=True)], "weight_decay": 0.0}]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cls(groups(args.weight_decay), **kwargs)
        except (ValueError, TypeError) as exc:
            issues.append(_optimizer_issue(recipe, cls, kwargs, groups, args.weight_decay, exc))
            return
    label = f"{cls.__module__.split('.')[0]}.{cls.__name__}"
    for caught_warning in caught:
        if issubclass(caught_warning.category, UserWarning):
            text = _one_line(caught_warning.message).removeprefix("hf_optim: ")
            found.append(text if text.startswith(cls.__name__) else f"{label}: {text}")


def _optimizer_issue(recipe: Recipe, cls, kwargs: dict, groups, weight_decay, exc: Exception) -> RecipeIssue:
    """The issue for a constructor's rejection, naming the training key behind the argument it refused."""
    from hf_optim.integrations.optim_args import OptimArgsError, parse_optim_args

    label = f"{cls.__module__.split('.')[0]}.{cls.__name__}"
    try:
        optim_args = set(parse_optim_args(recipe.training.get("optim_args")))
    except OptimArgsError:
        optim_args = set()

    def refuses(weight_decay, **arguments) -> bool:
        try:
            cls(groups(weight_decay), **arguments)
        except (ValueError, TypeError):
            return True
        return False

    culprits = [name for name, value in kwargs.items() if refuses(0.0, **{name: value})]
    if not culprits and weight_decay and refuses(weight_decay):
        culprits = ["weight_decay"]
    keys: list[str] = []
    for name in culprits:
        if name in optim_args or optim_args & set(_OPTIM_ARGS_ALIASES.get(name, ())) \
                or name not in _TRAINER_KWARG_KEYS:
            keys.append("optim_args" if recipe.training.get("optim_args") else "optim")
        else:  # the keys the recipe sets (adam_beta1 alone, say), else all of them (a bad default is unlikely)
            sources = _TRAINER_KWARG_KEYS[name]
            keys.extend([k for k in sources if k in recipe.training] or sources)
    keys = list(dict.fromkeys(keys))
    file, path = blamed(recipe.origin, "training", keys)
    values = ", ".join(f"{k}={recipe.training[k]!r}" for k in keys if k in recipe.training and k != "optim")
    refused = f" refuses {values}" if values else " refuses its arguments"
    return RecipeIssue(file, path, f"{label}{refused}: {_one_line(exc)}")


def _check_adapters(recipe: Recipe, issues: list[RecipeIssue]) -> None:
    """Apply the LoraConfig to the model built from its config on the meta device (no weights): peft's own checks,
    the target modules first. Skipped when the architecture is not known offline (``train`` then finds out)."""
    if recipe.peft is None:
        return
    from hf_optim.recipes.estimate import load_config, meta_peft_model

    try:
        config, _ = load_config(str(recipe.model["id"]))
    except LookupError:
        return
    values = dict(recipe.peft)

    def build(peft_values):
        meta_peft_model(config, torch.float32, peft_values)

    try:
        build(values)
    except (ValueError, TypeError, RuntimeError, KeyError, AttributeError) as exc:
        keys = culprit_keys(build, values)
        file, path = blamed(recipe.origin, "peft", keys)
        message = f"peft rejected {'this value' if len(keys) == 1 else 'these values'}: {_one_line(exc).rstrip('.')}"
        if "target_modules" in keys and isinstance(values.get("target_modules"), str):
            message += ("; a string is a regular expression matched against each module's full name "
                        "(model.layers.0.self_attn.q_proj); to match by name give a list: "
                        f"[{values['target_modules']}]")
        issues.append(RecipeIssue(file, path, message))


def check_model_source(recipe: Recipe) -> Recipe:
    """Make sure ``train`` can load the recipe's model and tokenizer; returns the recipe to train (a copy with
    ``model.local_files_only: true`` when the Hub is unreachable but the files are cached, noted in ``notes``).

    A local directory or the builtin model needs nothing. A Hub id is looked up in the Hugging Face cache, then,
    unless ``HF_HUB_OFFLINE`` is set, with one request to the Hub without retries (huggingface_hub retries a failed
    connection five times per file, with waits, before it fails: about a minute of "Retrying" lines).

    Raises:
        RecipeError: naming ``model.id`` (or ``model.tokenizer``) when its files are neither cached nor reachable
            (with what to do instead), or when the Hub says the model does not exist or is gated.
    """
    from hf_optim.tiny import BUILTIN_MODEL

    sources = {"model.id": recipe.model.get("id")}
    if recipe.model.get("tokenizer"):
        sources["model.tokenizer"] = recipe.model["tokenizer"]
    from_cache, issues = [], []
    for path, repo in sources.items():
        repo = str(repo)
        if repo == BUILTIN_MODEL or Path(repo).expanduser().is_dir():
            continue
        state, problem = _hub_state(repo, recipe.model.get("revision"), recipe.model.get("token"))
        if state == "cached":
            from_cache.append(f"{path} {repo!r}")
        elif state == "missing":
            issues.append(RecipeIssue(recipe.origin(path), path, f"{repo!r}: {problem}"))
    if issues:
        raise RecipeError(issues)
    if not from_cache or recipe.model.get("local_files_only"):
        return recipe
    changed = copy.deepcopy(recipe)
    changed.model["local_files_only"] = True
    changed.notes.append(f"the Hugging Face Hub cannot be reached: {', '.join(from_cache)} loaded from the local cache "
                         "(model.local_files_only: true)")
    return changed


def _hub_state(repo: str, revision: str | None, token) -> tuple[str, str | None]:
    """(state, why) for Hub model ``repo``: ``ok`` (reachable, or cached and ``HF_HUB_OFFLINE`` set), ``cached``
    (cached, the Hub unreachable: load with ``local_files_only``) or ``missing`` (``why`` says what to do)."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    cached = isinstance(try_to_load_from_cache(repo, "config.json", revision=revision), str)
    if constants.HF_HUB_OFFLINE:
        return ("ok", None) if cached else ("missing", "not in the local Hugging Face cache, and HF_HUB_OFFLINE is "
                                            f"set; {OFFLINE_HINT}")
    try:
        get_hf_file_metadata(hf_hub_url(repo, "config.json", revision=revision), token=token, timeout=10)
    except GatedRepoError:
        return ("ok", None) if cached else ("missing", "a gated model: accept its license on huggingface.co and log "
                                            "in (`hf auth login`), or set model.id to a local copy")
    except RepositoryNotFoundError:
        return ("ok", None) if cached else ("missing", "no such model on the Hugging Face Hub (or a private one: log "
                                            "in with `hf auth login`); check model.id")
    except HfHubHTTPError:
        return "ok", None  # the Hub answered (a missing file, a server error): from_pretrained says what it is
    except Exception as exc:
        if not _unreachable(exc):
            raise
        if cached:
            return "cached", None
        return "missing", (f"not in the local Hugging Face cache, and the Hub cannot be reached ({_one_line(exc)}); "
                           f"{OFFLINE_HINT}")
    return "ok", None


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure to reach the server (DNS, refused, timeout, offline mode), through the HTTP
    client's wrappers (httpx's ConnectError is no OSError; the socket error it wraps is)."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, HfHubHTTPError):
            return False
        if isinstance(current, (OSError, OfflineModeIsEnabled)):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False
