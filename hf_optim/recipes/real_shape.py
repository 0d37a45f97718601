"""``hf-optim train RECIPE --random-weights``: the recipe's model at its real shape, with random weights, offline.

Measure before you download: the model is built from its architecture (the Hub config when it can be read, else the
bundled Llama 3.x values, as ``hf-optim validate`` does), filled with random weights, and loaded through the same
``from_pretrained`` call as a checkpoint (``state_dict=``), so QLoRA quantizes through bitsandbytes, ``device_map``
and the dtype apply as they would. Everything else is the recipe's: LoRA through peft, the optimizer, gradient
checkpointing, precision, the monitor's logging. What changes:

- the tokenizer is the bundled one (ids < 800, every one inside the architecture's vocabulary; the embedding keeps
  the architecture's full size) and the data is the bundled chat data, tokenized once and cut into rows of exactly
  ``max_length`` tokens (no padding, so every step has batch x sequence tokens);
- ``max_steps`` (default 3), no checkpoints, no evaluation, no warmup (a few steps with warmup barely move the
  weights), and no saved model at the end (random weights are not worth the disk); Ctrl-C stops after the step
  under way without a checkpoint;
- gradient accumulation 1: a step is one batch, measured in an eighth of the time a recipe with
  ``gradient_accumulation_steps: 8`` takes. Accumulating keeps the gradients alive through the next micro-batch's
  forward, so the recipe's own peak can be higher by up to the gradients' size (small under LoRA, as large as the
  trainable weights in a full fine-tune); the estimate beside the measurement is for the same settings, and
  ``training.gradient_accumulation_steps=N`` on the command line measures N (N times the time);
- ``--seq-len`` and ``--batch-size`` set ``training.max_length`` and ``per_device_train_batch_size``.

The one line the run prints first says all of this with the numbers of this run (steps, batch x tokens,
accumulation, and the recipe's accumulation when it is not applied). On a CPU a step of a billion-parameter model
takes minutes: the progress bar's clock moves every second, and it shows where the step under way is, layer by
layer (:meth:`ComponentProbe.progress_detail`).

Besides the monitor's files the run directory gets :data:`MEMORY_FILE`: the measured peak memory by component
beside the planner's estimate for the same settings (:func:`estimate_components`):

- weights, adapters, gradients, optimizer state: bytes of the tensors themselves (each storage once; 4-bit weights
  with their quantization constants), read from the model and the optimizer;
- the peak: on CUDA, torch's allocator peak of each step (plus NVML's device-wide figure); on CPU, the tensor bytes
  alive at the start of each step (weights, adapters, state) plus the peak of the CPU allocator's own allocation
  events during the step (``torch.profiler`` with ``profile_memory=True``: every tensor allocated and freed within
  the step, by the allocator that made it; process RSS would add the Python heap, libraries and freed pages);
- activations = peak - weights - adapters - optimizer state (on the device) - gradients, on both sides: the
  activation estimate's own definition (:mod:`hf_optim.recipes.activations`) with the other parts taken out.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_optim.notices import native_lines_hidden
from hf_optim.recipes.errors import RecipeError, RecipeIssue
from hf_optim.recipes.loading import COMMAND_LINE, RawRecipe, deep_merge
from hf_optim.recipes.schema import Recipe
from hf_optim.tiny import BUILTIN_DATA, CHAT_FILE, bundled_tokenizer

logger = logging.getLogger("hf_optim")

DEFAULT_STEPS = 3
MEMORY_FILE = "memory_by_component.json"
COMPONENTS = ("weights", "adapters", "gradients", "optimizer_state", "activations")
SEED = 0

# Settings a few measured steps do not use (or must not do: checkpoints of random weights, evaluation).
_DROP_TRAINING = ("num_train_epochs", "warmup_ratio", "eval_steps", "save_steps", "packing", "packing_strategy",
                  "padding_free", "resume_from_checkpoint", "load_best_model_at_end", "push_to_hub", "hub_model_id",
                  "dataset_text_field", "completion_only_loss", "assistant_only_loss")


@dataclass(frozen=True)
class RandomWeights:
    """What ``--random-weights`` changes (None: the recipe's own value)."""

    steps: int = DEFAULT_STEPS
    seq_len: int | None = None
    batch_size: int | None = None


def check_options(steps: int | None, seq_len: int | None, batch_size: int | None) -> RandomWeights:
    """The options as given on the command line, each a positive integer (one line naming the bad one)."""
    for flag, value in (("--steps", steps), ("--seq-len", seq_len), ("--batch-size", batch_size)):
        if value is not None and value < 1:
            raise RecipeError([RecipeIssue(COMMAND_LINE, flag, f"must be a positive integer, got {value}")])
    return RandomWeights(steps or DEFAULT_STEPS, seq_len, batch_size)


def random_weights_recipe(raw: RawRecipe, options: RandomWeights) -> RawRecipe:
    """``raw`` as a random-weights run (before command-line overrides, so those still apply)."""
    data = copy.deepcopy(raw.data)
    training = {k: v for k, v in (data.get("training") or {}).items() if k not in _DROP_TRAINING}
    forced = {"max_steps": options.steps, "save_strategy": "no", "eval_strategy": "no", "logging_steps": 1,
              "warmup_steps": 0, "report_to": "none", "gradient_accumulation_steps": 1}
    if not torch.cuda.is_available():
        forced["dataloader_pin_memory"] = False  # nothing to pin to: torch warns at every run otherwise
    if options.seq_len is not None:
        forced["max_length"] = options.seq_len
    if options.batch_size is not None:
        forced["per_device_train_batch_size"] = options.batch_size
    data["training"] = deep_merge(training, forced)
    model = dict(data.get("model") or {})
    if not torch.cuda.is_available() and str(model.get("device_map", "")).startswith("cuda"):
        model.pop("device_map")  # a GPU recipe measured on a CPU
    data["model"] = model
    data["data"] = {"path": BUILTIN_DATA}
    origins = dict(raw.origins)
    for path in [p for p in origins if p == "data" or p.startswith("data.")]:
        origins[path] = "random-weights mode"
    for key in forced:
        origins[f"training.{key}"] = "random-weights mode"
    replaced = ("data", "model.device_map", *(f"training.{key}" for key in forced))
    words = {path: word for path, word in raw.bool_words.items()  # the words of the values this mode kept
             if not any(path == key or path.startswith(key + ".") for key in replaced)}
    return RawRecipe(data, raw.source, origins, words)


def load(name_or_path: str | Path, overrides: list[str] | tuple[str, ...], options: RandomWeights) -> Recipe:
    """Read, turn into a random-weights run, override and validate a recipe; then the checks ``train`` runs before
    loading a model (no Hub access: nothing is downloaded)."""
    from hf_optim.recipes.estimate import load_config
    from hf_optim.recipes.loading import apply_overrides, load_raw
    from hf_optim.recipes.preflight import preflight
    from hf_optim.recipes.schema import validate

    original = load_raw(name_or_path)
    raw = random_weights_recipe(original, options)
    recipe = validate(apply_overrides(raw, list(overrides)))
    preflight(recipe)
    try:
        load_config(str(recipe.model["id"]))
    except LookupError as exc:
        raise RecipeError([RecipeIssue(recipe.origin("model.id"), "model.id", str(exc))]) from None
    recipe.notes.append(what_runs(recipe, original.data.get("training") or {}))
    return recipe


def what_runs(recipe: Recipe, recipe_training: dict) -> str:
    """The one line a random-weights run prints first: what it builds and what it runs (``recipe_training``: the
    recipe file's own ``training`` section, to name the accumulation it does not apply)."""
    accumulation = accumulation_of(recipe)
    said = recipe_training.get("gradient_accumulation_steps")
    if recipe.origin("training.gradient_accumulation_steps") == COMMAND_LINE:
        accumulation_text = f"gradient accumulation {accumulation} (command line)"
    elif isinstance(said, int) and said != accumulation:
        accumulation_text = (f"gradient accumulation {accumulation} (the recipe's {said} is not applied: "
                             f"training.gradient_accumulation_steps={said} applies it)")
    else:
        accumulation_text = f"gradient accumulation {accumulation}"
    steps = recipe.training["max_steps"]
    return (f"random-weights mode: {recipe.model['id']} built from its architecture with random weights, bundled "
            f"tokenizer and data; {steps} step{'s' if steps != 1 else ''} of batch {batch_of(recipe)} x "
            f"{seq_len_of(recipe)} tokens, {accumulation_text}; no warmup, evaluation, checkpoint or saved model")


# -- building ------------------------------------------------------------------------------------------------------

def architecture(recipe: Recipe, tokenizer, seq_len: int):
    """(config, where it came from): the planner's config for ``model.id``, with the tokenizer's special ids and room
    for ``seq_len`` positions."""
    from hf_optim.recipes.estimate import load_config

    config, source = load_config(str(recipe.model["id"]))
    config = copy.deepcopy(config)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    if getattr(config, "max_position_embeddings", seq_len) < seq_len:
        config.max_position_embeddings = seq_len
    if len(tokenizer) > config.vocab_size:
        raise RecipeError([RecipeIssue(recipe.source, "model.id", f"the bundled tokenizer has {len(tokenizer)} tokens, "
                                       f"more than this architecture's vocabulary ({config.vocab_size})")])
    return config, source


def random_state_dict(config, dtype: torch.dtype, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Random weights for every parameter of ``config``'s causal LM (a tied weight once), on the CPU in ``dtype``:
    matrices from N(0, initializer_range), vectors (the norms' weights) ones, as the model's own init does. Drawn on
    the GPU when there is one (much faster for billions of weights), one tensor at a time."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(config, dtype=dtype)
    std = float(getattr(config, "initializer_range", 0.02))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    generator = torch.Generator(device).manual_seed(seed)
    state = {}
    for name, param in shapes.named_parameters():  # remove_duplicate: a tied weight appears once
        if param.dim() < 2:
            state[name] = torch.ones(param.shape, dtype=dtype)
            continue
        value = torch.empty(param.shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)
        state[name] = value.cpu() if device.type != "cpu" else value
    return state


def build_random_model(recipe: Recipe, tokenizer, seq_len: int):
    """The recipe's model with random weights, loaded by ``from_pretrained`` (quantization, dtype, device_map)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from hf_optim.recipes.build import model_kwargs

    config, source = architecture(recipe, tokenizer, seq_len)
    kwargs = {k: v for k, v in model_kwargs(recipe).items()
              if k not in ("revision", "token", "local_files_only", "trust_remote_code", "cache_dir")}
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
    with torch.device("meta"):
        count = sum(p.numel() for p in
                    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).parameters())  # a tied weight once
    size = count * torch.empty((), dtype=dtype).element_size()
    logger.info("random weights: %s, %.2fB parameters (%.1f GiB in %s), architecture from %s", recipe.model["id"],
                count / 1e9, size / 2**30, str(dtype).removeprefix("torch."), source)
    state = random_state_dict(config, dtype)
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(None, config=config, state_dict=state, **kwargs)


def token_rows(tokenizer, seq_len: int, rows_needed: int):
    """The bundled chat data in the chat template, tokenized, concatenated and cut into rows of exactly ``seq_len``
    tokens (repeated when one pass is not enough for ``rows_needed`` rows): a pre-tokenized dataset, which TRL
    takes as it is."""
    from datasets import Dataset

    stream: list[int] = []
    for line in CHAT_FILE.read_text().splitlines():
        if line.strip():
            text = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=False)
            stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    rows = max(rows_needed, len(stream) // seq_len)
    repeats = math.ceil(rows * seq_len / len(stream))
    stream = (stream * repeats)[: rows * seq_len]
    return Dataset.from_dict({"input_ids": [stream[i * seq_len:(i + 1) * seq_len] for i in range(rows)]})


def seq_len_of(recipe: Recipe) -> int:
    return int(recipe.training.get("max_length") or recipe.training.get("max_seq_length") or 1024)


def batch_of(recipe: Recipe) -> int:
    return int(recipe.training.get("per_device_train_batch_size") or 8)


def checkpointing_of(recipe: Recipe) -> bool:
    """Gradient checkpointing on (transformers 5 renamed ``gradient_checkpointing`` to ``activation_checkpointing``;
    the recipe check passes the new name)."""
    training = recipe.training
    return bool(training.get("activation_checkpointing", training.get("gradient_checkpointing")))


def accumulation_of(recipe: Recipe) -> int:
    return int(recipe.training.get("gradient_accumulation_steps") or 1)


def build(recipe: Recipe):
    """(tokenizer, train dataset, model) of a random-weights run of the resolved ``recipe``."""
    tokenizer = bundled_tokenizer()
    seq_len = seq_len_of(recipe)
    data = token_rows(tokenizer, seq_len, batch_of(recipe) * accumulation_of(recipe))
    return tokenizer, data, build_random_model(recipe, tokenizer, seq_len)


# -- the planner's estimate for the same settings --------------------------------------------------------------------

@dataclass
class ComponentEstimate:
    """The planner's figures for one step of a random-weights run, in bytes (see the module docstring)."""

    weights: int
    adapters: int
    gradients: int
    optimizer_state: int | None
    optimizer_state_on_device: int
    activations: int
    peak: int
    notes: list[str] = field(default_factory=list)


def _element_size(name, default: int) -> int:
    from hf_optim.recipes.build import torch_dtype

    dtype = torch_dtype(name) if isinstance(name, str) and name != "auto" else name
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else default


def estimate_components(recipe: Recipe, device: torch.device) -> ComponentEstimate:
    """The estimate of a random-weights run of the resolved ``recipe`` on ``device`` (``auto`` resolved): weights,
    adapters, gradients and state from :func:`hf_optim.recipes.estimate.estimate`; activations from
    :func:`hf_optim.recipes.activations.training_peak_bytes` with TRL's chunked LM head."""
    from hf_optim.integrations.names import OPTIMIZER_NAMES
    from hf_optim.recipes.activations import Adapters, DecoderShape, LossHead, training_peak_bytes
    from hf_optim.recipes.estimate import TORCH_STATE_COUNT, estimate, meta_peft_model

    est = estimate(recipe)
    notes = list(est.notes)
    weights_size = _element_size(recipe.model.get("dtype", recipe.model.get("torch_dtype")), 2)
    compute_size = weights_size
    autocast = recipe.training.get("bf16") is True or recipe.training.get("fp16") is True
    if autocast:
        compute_size = 2
    if recipe.method == "qlora":
        compute_size = _element_size((recipe.quantization or {}).get("bnb_4bit_compute_dtype"), compute_size)
    shape = DecoderShape.from_config(est.config, compute_size)
    tokens = seq_len_of(recipe) * batch_of(recipe)
    trainable = sum(t.numel * t.element_size for t in est.tensors)
    adapters = None
    if recipe.method != "full":
        model = meta_peft_model(est.config, torch.float32, recipe.peft or {})
        rank = int((recipe.peft or {}).get("r", 8))
        widths = tuple(m.in_features for n, m in model.named_modules()
                       if n.endswith(".lora_A.default") and ".layers.0." in n)
        largest = max((m.in_features * m.out_features for m in est_linear_weights(est.config)), default=0)
        adapters = Adapters(rank, widths, max(t.element_size for t in est.tensors) if est.tensors else 4,
                            largest if recipe.method == "qlora" else 0)
    head = LossHead(fused=_trl_fuses_head(), torch_tiles=not _trl_uses_triton(device), trainable=adapters is None,
                    compute_size=compute_size)
    if not head.fused:
        notes.append("this TRL has no chunked LM head: the loss head is counted with full logits")
    checkpointing = checkpointing_of(recipe)
    activations_and_grads = training_peak_bytes(shape, tokens, checkpointing, head, adapters,
                                                gradient_bytes=trainable, accumulating=accumulation_of(recipe) > 1)
    state = est.state_bytes
    entry = OPTIMIZER_NAMES.get(recipe.optim)
    paged = bool(entry is not None and entry.paged) or recipe.optim.startswith("paged_")
    state_on_device = 0 if paged and device.type == "cuda" else (state or 0)
    if paged and device.type == "cuda":
        notes.append("paged optimizer state lives in CUDA managed memory, which torch's allocator does not count: it "
                     "is left out of the allocator peak on both sides (NVML sees it)")
    step_extra = trainable if recipe.optim in TORCH_STATE_COUNT else 0  # torch's foreach AdamW: one temporary
    adapters_bytes = trainable if recipe.method != "full" else 0
    base = est.weights_bytes - adapters_bytes
    peak = base + adapters_bytes + state_on_device + max(activations_and_grads, trainable + step_extra)
    activations = peak - base - adapters_bytes - state_on_device - trainable
    return ComponentEstimate(base, adapters_bytes, trainable, state, state_on_device, activations, peak, notes)


def est_linear_weights(config):
    """The decoder's linear layers, built on the meta device (for the largest 4-bit weight's size)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]


def _trl_fuses_head() -> bool:
    try:
        from trl.trainer.utils import add_fused_lm_head  # noqa: F401
    except ImportError:
        return False
    return True


def _trl_uses_triton(device: torch.device) -> bool:
    try:
        from trl.kernels.chunked_logprob import _use_triton
    except ImportError:
        return device.type == "cuda"
    return bool(_use_triton(device))


# -- measuring ------------------------------------------------------------------------------------------------------

def _storages(tensors) -> dict[tuple[str, int], int]:
    """Bytes of each distinct storage among ``tensors`` (views and tied weights once)."""
    found: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0 or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        found[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return found


def _quant_state_tensors(param) -> list[torch.Tensor]:
    """A bitsandbytes 4-bit weight's quantization constants (absmax, code, the nested ones of double quantization)."""
    state = getattr(param, "quant_state", None)
    out = []
    while state is not None:
        out += [t for t in (getattr(state, "absmax", None), getattr(state, "code", None),
                            getattr(state, "offset", None)) if isinstance(t, torch.Tensor)]
        state = getattr(state, "state2", None)
    return out


def model_bytes(model) -> tuple[int, int]:
    """(weights, adapters): bytes of the frozen parameters (4-bit ones with their quantization constants) and of
    the trainable ones. Buffers (RoPE's inverse frequencies: a few hundred bytes) are no weights and not counted."""
    params = list(model.parameters())
    trainable = _storages(p for p in params if p.requires_grad)
    frozen = _storages([p for p in params if not p.requires_grad] +
                       [t for p in params for t in _quant_state_tensors(p)])
    return sum(v for k, v in frozen.items() if k not in trainable), sum(trainable.values())


def _gradient_bytes(model) -> int:
    return sum(_storages(p.grad for p in model.parameters() if p.grad is not None).values())


def _profiler_peak(prof) -> int:
    """The highest total of CPU allocations made during the profile and alive at once (frees of blocks allocated
    before it started are not reported by the allocator, so the figure is on top of what was alive at the start)."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        if event.device_type() == torch._C._autograd.DeviceType.CPU:
            live += event.nbytes()
            peak = max(peak, live)
    return peak


# The profiler's C++ side prints a line at every start and stop (``USDT:<time> <pid>:<tid>
# SyncActivityProfilerHandler.cpp:52] profiler_start``), straight to file descriptor 2; no setting turns it off.
_PROFILER_LINE = r"USDT:.*\] profiler_(start|stop)"


def _profiler_lines_hidden():
    return native_lines_hidden(_PROFILER_LINE)


def _trainer_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers, in order: transformers' ``GradientCheckpointingLayer`` modules (every decoder
    layer of transformers 5), else the children of its longest ``nn.ModuleList``."""
    with contextlib.suppress(ImportError):
        from transformers.modeling_layers import GradientCheckpointingLayer

        found = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        if found:
            return found
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


class ComponentProbe:
    """A TrainerCallback that measures a random-weights run by component (see the module docstring); built by
    :func:`probe` so that transformers is imported only when a run starts. It also follows the step under way layer
    by layer (:meth:`progress_detail`): on a CPU one step of a billion-parameter model takes minutes."""

    def __init__(self, device: torch.device, checkpointing: bool = False, accumulation: int = 1):
        self.device = device
        self.checkpointing = checkpointing
        self.accumulation = accumulation
        self._layers = 0
        self._forwards = self._backwards = 0
        self._hooks: list = []
        self._step: int | None = None
        self._in_optimizer = False
        self.weights = self.adapters = 0
        self.gradients = 0
        self.state = None
        self.model = None
        self.optimizer = None
        self.steps: list[dict] = []
        self._profile = None
        self._baseline = 0
        self._t_step = self._t_opt = 0.0
        self._opt_seconds = 0.0
        self._nvml = None
        self.nvml_peak: int | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.model, self.optimizer = model, optimizer
        self.weights, self.adapters = model_bytes(model)
        layers = decoder_layers(model)
        self._layers = len(layers)
        # forward: a pre-hook (transformers' checkpointing wraps a layer's forward, so its recompute in the backward
        # does not call the hook again); backward: a full backward pre-hook, called when the gradient reaches the
        # layer's output (identity functions on the outputs: no copy, no change to the math)
        self._hooks = [hook for layer in layers for hook in (layer.register_forward_pre_hook(self._forward_called),
                                                             layer.register_full_backward_pre_hook(
                                                                 self._backward_called))]
        if self.device.type == "cuda":
            from hf_optim.monitor.nvml_memory import NvmlMemory

            self._nvml = NvmlMemory(self.device.index or 0, getattr(torch.cuda.get_device_properties(self.device),
                                                                    "uuid", None))
            torch.cuda.reset_peak_memory_stats(self.device)

    def _state_bytes(self) -> tuple[int, int]:
        from hf_optim.memory import state_memory
        from hf_optim.monitor.accounting import unwrap_optimizer

        if self.optimizer is None:
            return 0, 0
        found = state_memory(unwrap_optimizer(self.optimizer))
        return found.total_bytes, found.paged_bytes

    def _forward_called(self, module, args) -> None:
        self._forwards += 1

    def _backward_called(self, module, grad_output) -> None:
        self._backwards += 1

    def progress_detail(self) -> str | None:
        """Where the step under way is: ``step 1: forward 9/16 layers`` (the layer whose forward runs),
        ``step 1: backward 3/16 layers`` (counted from the last layer, as the backward runs; with gradient
        checkpointing each layer's forward is recomputed there), ``step 1: optimizer step``; with accumulation the
        micro-batch too. None before the first step."""
        if self._step is None or not self._layers:
            return None
        if self._in_optimizer:
            return f"step {self._step}: optimizer step"
        micro = max(self._forwards - 1, 0) // self._layers
        forward, backward = self._forwards - micro * self._layers, self._backwards - micro * self._layers
        where = f"backward {backward}/{self._layers} layers" if backward > 0 else \
            f"forward {forward}/{self._layers} layers"
        batch = f", micro-batch {micro + 1}/{self.accumulation}" if self.accumulation > 1 else ""
        return f"step {self._step}{batch}: {where}"

    def on_train_end(self, args, state, control, **kwargs):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._step, self._forwards, self._backwards, self._in_optimizer = state.global_step + 1, 0, 0, False
        self._sync()
        self._opt_seconds = 0.0
        if self.device.type == "cpu":
            from torch.profiler import ProfilerActivity, profile

            total, _ = self._state_bytes()
            self._baseline = self.weights + self.adapters + total + _gradient_bytes(self.model)
            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _profiler_lines_hidden():
                self._profile.start()
        self._t_step = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._in_optimizer = True
        self._sync()
        self._t_opt = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._sync()
        self._opt_seconds += time.perf_counter() - self._t_opt
        self.gradients = max(self.gradients, _gradient_bytes(self.model))  # still held: zeroed after this event

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        seconds = time.perf_counter() - self._t_step
        record = {"step": state.global_step, "seconds": seconds, "optimizer_seconds": self._opt_seconds}
        if self._profile is not None:
            with _profiler_lines_hidden():
                self._profile.stop()
            record["peak_bytes"] = self._baseline + _profiler_peak(self._profile)
            record["baseline_bytes"] = self._baseline
            self._profile = None
        elif self.device.type == "cuda":
            record["peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            record["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
            if self._nvml is not None:
                used = self._nvml.sample().get("nvml_process_bytes") or self._nvml.sample().get("nvml_used_bytes")
                if used is not None:
                    self.nvml_peak = max(self.nvml_peak or 0, used)
        self.state = self._state_bytes()
        self.steps.append(record)


def probe(device: torch.device, checkpointing: bool = False, accumulation: int = 1):
    """A :class:`ComponentProbe` that is a ``transformers.TrainerCallback``."""
    cls = type("ComponentProbeCallback", (ComponentProbe, _trainer_callback_base()), {})
    return cls(device, checkpointing, accumulation)


def report(recipe: Recipe, measured: ComponentProbe, estimated: ComponentEstimate, losses: list[float],
           tokens_per_step: int) -> dict:
    """The contents of :data:`MEMORY_FILE`."""
    state_total, paged = measured.state or (0, 0)
    state_on_device = state_total - paged if measured.device.type == "cuda" else state_total
    peaks = [s["peak_bytes"] for s in measured.steps if "peak_bytes" in s]
    peak = max(peaks) if peaks else None
    rows = {"weights": (estimated.weights, measured.weights), "adapters": (estimated.adapters, measured.adapters),
            "gradients": (estimated.gradients, measured.gradients),
            "optimizer_state": (estimated.optimizer_state, state_total),
            "activations": (estimated.activations, None if peak is None else
                            peak - measured.weights - measured.adapters - state_on_device - measured.gradients),
            "peak": (estimated.peak, peak)}
    later = measured.steps[1:] or measured.steps
    step_seconds = sum(s["seconds"] for s in later) / len(later) if later else None
    opt_seconds = sum(s["optimizer_seconds"] for s in later) / len(later) if later else None
    return {
        "recipe": recipe.source,
        "model": recipe.model["id"],
        "method": recipe.method,
        "optim": recipe.optim,
        "device": str(measured.device),
        "device_name": torch.cuda.get_device_name(measured.device) if measured.device.type == "cuda" else "cpu",
        "basis": ("torch.cuda.max_memory_allocated per step" if measured.device.type == "cuda" else
                  "tensor bytes alive at step start + peak of the CPU allocator's events in the step (torch.profiler)"),
        "seq_len": seq_len_of(recipe), "batch_size": batch_of(recipe),
        "gradient_accumulation_steps": accumulation_of(recipe),
        "gradient_checkpointing": checkpointing_of(recipe),
        "components": {name: {"estimate_bytes": est, "measured_bytes": got,
                              "measured_over_estimate": (got / est) if est and got is not None else None}
                       for name, (est, got) in rows.items()},
        "optimizer_state_paged_bytes": paged,
        "optimizer_state_on_device_estimate_bytes": estimated.optimizer_state_on_device,
        "nvml_peak_process_bytes": measured.nvml_peak,
        "losses": losses,
        "step_seconds_after_first": step_seconds,
        "optimizer_step_seconds_after_first": opt_seconds,
        "optimizer_step_share": (opt_seconds / step_seconds) if step_seconds and opt_seconds is not None else None,
        "tokens_per_second_after_first": (tokens_per_step / step_seconds) if step_seconds else None,
        "steps": measured.steps,
        "estimate_notes": estimated.notes,
    }


def train(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = (), options: RandomWeights | None = None,
          output_dir: str | Path | None = None, quiet: bool = False, overwrite: bool = False):
    """Train ``name_or_path`` with random weights (see the module docstring); returns the
    :class:`~hf_optim.recipes.train.RunResult`, whose ``memory`` holds what :data:`MEMORY_FILE` holds. The default
    run directory is the recipe's with ``-random-weights`` appended, so a real run's directory is never touched."""
    from hf_optim.recipes.train import default_output_dir, run

    recipe = load(name_or_path, overrides, options or RandomWeights())
    out = Path(output_dir) if output_dir is not None else \
        default_output_dir(recipe).with_name(default_output_dir(recipe).name + "-random-weights")
    return run(recipe, out, quiet=quiet, overwrite=overwrite, measure=RandomWeightsRun)


class RandomWeightsRun:
    """The parts of a random-weights run that :func:`hf_optim.recipes.train.run` calls (its ``measure``): the
    estimate, made before loading, the probe that measures, the build, and the report."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe  # auto already resolved for this machine
        use_cpu = bool(recipe.training.get("use_cpu")) or not torch.cuda.is_available()
        self.device = torch.device("cpu") if use_cpu else torch.device("cuda", torch.cuda.current_device())
        self.estimate = estimate_components(recipe, self.device)
        self.probe = probe(self.device, checkpointing_of(recipe), accumulation_of(recipe))

    def build(self):
        return build(self.recipe)

    def finish(self, out: Path, losses: list[float], status: str) -> dict:
        tokens = seq_len_of(self.recipe) * batch_of(self.recipe) * accumulation_of(self.recipe)
        data = {"status": status, **report(self.recipe, self.probe, self.estimate, losses, tokens)}
        path = write_report(out, data)
        logger.info("memory by component, measured beside the estimate: %s", path)
        return data


def cli_train(args, console, quiet: bool) -> int:
    """``hf-optim train RECIPE --random-weights [--steps N] [--seq-len L] [--batch-size B]``."""
    from hf_optim.errors import UserValueError

    if not args.random_weights:
        given = [f for f, v in (("--steps", args.steps), ("--seq-len", args.seq_len), ("--batch-size", args.batch_size))
                 if v is not None]
        raise UserValueError(f"{', '.join(given)}: only with --random-weights (a real run takes training.max_steps, "
                             "training.max_length and training.per_device_train_batch_size as overrides)")
    for flag, value in (("--sweep", args.sweep), ("--resume", args.resume), ("--smoke", args.smoke)):
        if value:
            raise UserValueError(f"--random-weights runs one recipe from step 0 at its real shape; it does not combine "
                                 f"with {flag}")
    options = check_options(args.steps, args.seq_len, args.batch_size)
    result = train(args.recipe, args.overrides, options, args.output_dir, quiet=quiet, overwrite=args.overwrite)
    data = result.memory or {}
    for line in table_lines(data) if data.get("steps") else []:
        console.print(line, highlight=False)
    if result.status in ("interrupted", "killed"):
        stopped = f"killed by {result.signal}" if result.status == "killed" else "interrupted"
        at = "" if result.global_step is None else f" at step {result.global_step}"
        measured = f" (measured so far: {MEMORY_FILE})" if data.get("steps") else ""
        print(f"{stopped}{at}{measured}; a random-weights run keeps no checkpoint: run it again with --overwrite",
              file=sys.stderr)
        return result.exit_status or 130
    losses = ", ".join(f"{loss:.4f}" for loss in data.get("losses", []))
    console.print(f"{data.get('seq_len')} tokens x batch {data.get('batch_size')} on {data.get('device_name')}; "
                  f"losses: {losses or '-'}", highlight=False)
    console.print(f"run directory: {result.output_dir} ({MEMORY_FILE}, metrics.jsonl, summary.json; no model saved)",
                  highlight=False)
    if result.status == "oom":
        console.print(f"[red]out of memory[/red]; recorded in {result.output_dir / 'summary.json'}")
        return 3
    return 0


def write_report(out: Path, data: dict) -> Path:
    path = out / MEMORY_FILE
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def table_lines(data: dict) -> list[str]:
    """The report as plain text lines: one row per component, estimate and measured in GiB and their ratio."""
    lines = [f"{'component':<16} {'estimate GiB':>13} {'measured GiB':>13} {'measured/est':>13}"]
    for name, row in data["components"].items():
        est, got, ratio = row["estimate_bytes"], row["measured_bytes"], row["measured_over_estimate"]
        lines.append(f"{name:<16} {_gib(est):>13} {_gib(got):>13} {'-' if ratio is None else f'{ratio:.3f}':>13}")
    return lines


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.3f}"


__all__ = ["COMPONENTS", "ComponentEstimate", "MEMORY_FILE", "RandomWeights", "RandomWeightsRun", "build",
           "check_options", "cli_train", "estimate_components", "load", "probe", "random_weights_recipe", "report",
           "table_lines", "train", "write_report"]
