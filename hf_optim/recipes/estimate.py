"""``hf-optim validate``'s memory estimate: weights + gradients + optimizer state, from the architecture alone.

The model is built from its config on the meta device (no weights, no download), LoRA is applied there too,
and every trainable tensor is counted with the state format of the chosen optimizer name:

* hf_optim's (and bitsandbytes') names: the bytes of the algorithm's state slots, from its description
  (``Algorithm.bytes_per_tensor``): 8-bit, per slot row 1 byte per element plus a 4-byte absmax per block of 256,
  and the slot's 1 KiB quantization map; 4-bit, half a byte per element plus a 4-byte absmax per block of 128;
  both except tensors under 4096 elements and ``nn.Embedding`` weights, which keep fp32 state (4 bytes per
  element); 32-bit, 4 bytes per element per slot row, whatever the parameter dtype;
  Adafactor: factored second moment (rows + columns, fp32) for matrices, full for vectors, plus an 8-bit or no
  first moment;
* torch's AdamW (``adamw_torch``, ``adamw_torch_fused``, ...): two states in the parameter's dtype.

Activations, the CUDA context and allocator fragmentation are not included: the figures are a floor.
"""

from __future__ import annotations

import math
import socket
import warnings
from dataclasses import dataclass, field

import torch

from hf_optim.integrations.names import OPTIMIZER_NAMES
from hf_optim.optim.registry import families
from hf_optim.recipes.schema import Recipe

MIN_8BIT_SIZE = 4096
# transformers' own (non-bitsandbytes) names whose state is torch's: count of states kept in the parameter dtype.
TORCH_STATE_COUNT = {"adamw_torch": 2, "adamw_torch_fused": 2, "adamw_torch_xla": 2, "adamw_torch_npu_fused": 2,
                     "adamw_apex_fused": 2, "adagrad": 1, "rmsprop": 1, "sgd": 0}
NF4_BLOCK = 64  # bitsandbytes' 4-bit blocksize: one absmax per 64 weights

# Public config values of the Llama 3.x models (their configs are gated on the Hub): used only when the Hub
# config cannot be read, and the output says so.
KNOWN_ARCHITECTURES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama-3.3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}


def known_architecture(model_id: str) -> dict | None:
    """The bundled architecture values for a Llama 3.x model id (any owner, ``-Instruct`` or not)."""
    name = model_id.rsplit("/", 1)[-1].lower().removeprefix("meta-").removesuffix("-instruct")
    return KNOWN_ARCHITECTURES.get(name)


@dataclass
class TensorCount:
    """One trainable tensor: elements, bytes per element, whether it is an ``nn.Embedding`` weight, and the mark
    each hybrid algorithm's partition put on it (by algorithm name; see
    :attr:`hf_optim.core.partition.Partition.mark_model`)."""

    numel: int
    element_size: int
    shape: tuple[int, ...]
    embedding: bool
    marks: dict[str, str | None] = field(default_factory=dict)


@dataclass
class MemoryEstimate:
    """Estimated training memory in bytes (activations excluded).

    Attributes:
        model_id: the recipe's model.
        config_source: where the architecture came from.
        method: ``full``, ``lora`` or ``qlora``.
        optim: the optimizer name.
        total_params: parameters of the base model.
        trainable_params: parameters the optimizer updates.
        weights_bytes: the model in memory (quantized weights with their constants for QLoRA, adapters included).
        gradient_bytes: one gradient per trainable parameter, in its dtype.
        state_bytes: optimizer state (None: no state model for this optimizer name).
        notes: assumptions worth showing.
        tensors: the trainable tensors counted (for the planner, which prices other optimizers on them).
        config: the model config the estimate was built from.
    """

    model_id: str
    config_source: str
    method: str
    optim: str
    total_params: int
    trainable_params: int
    weights_bytes: int
    gradient_bytes: int
    state_bytes: int | None
    notes: list[str] = field(default_factory=list)
    tensors: list[TensorCount] = field(default_factory=list, repr=False)
    config: object = field(default=None, repr=False)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.gradient_bytes + (self.state_bytes or 0)

    def per_param(self, nbytes: int | None) -> float | None:
        """``nbytes`` per model parameter (the unit the anchors quote: bytes/param of a full fine-tune)."""
        return None if nbytes is None else nbytes / self.total_params


def state_bytes(optim: str, tensors: list[TensorCount], optim_args: str | None = None) -> int | None:
    """Optimizer-state bytes of ``optim`` for ``tensors`` (None when the name has no state model here).
    ``optim_args``: the recipe's, for a hybrid optimizer's routing (Muon's ``muon_lora``)."""
    entry = OPTIMIZER_NAMES.get(optim)
    if entry is None:
        count = TORCH_STATE_COUNT.get(optim)
        return None if count is None else sum(count * t.numel * t.element_size for t in tensors)
    algorithm = entry.algorithm
    partition = algorithm.partition  # a hybrid: the rule each tensor takes
    kwargs = _typed_optim_args(entry, optim_args) if partition else {}
    total = 0
    for t in tensors:
        quantized = entry.state_format.quantized and t.numel >= MIN_8BIT_SIZE and not t.embedding
        rule = partition.label_for_mark(t.marks.get(algorithm.name), len(t.shape), kwargs) if partition else None
        total += algorithm.bytes_per_tensor(t.shape, quantized, entry.state_format, rule=rule)
    return total


def trainable_tensors(model: torch.nn.Module) -> list[TensorCount]:
    """The trainable tensors of ``model`` (a tied weight once), with the marks of every hybrid algorithm's
    partition (which rule each tensor would take)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    partitions = {f.algorithm.name: f.algorithm.partition for f in families() if f.algorithm.partition is not None}
    marks: dict[int, dict[str, str | None]] = {}
    for name, partition in partitions.items():
        partition.mark_model(model, {})  # an attribute on each trainable parameter, read only by that algorithm
        for p in model.parameters():
            marks.setdefault(id(p), {})[name] = getattr(p, partition.mark_attr, None)
    return [TensorCount(p.numel(), p.element_size(), tuple(p.shape), id(p) in embeddings, marks.get(id(p), {}))
            for p in model.parameters() if p.requires_grad]


def _typed_optim_args(entry, optim_args: str | None) -> dict:
    """``optim_args`` as the class reads them ({} when absent or invalid: the recipe check reports that)."""
    from hf_optim.integrations.optim_args import OptimArgsError, parse_optim_args, typed_optim_args

    try:
        return typed_optim_args(entry, parse_optim_args(optim_args)) if optim_args else {}
    except OptimArgsError:
        return {}


def _hub_reachable(timeout: float = 3.0) -> bool:
    import os

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_config(model_id: str):
    """(config, source): the model's config from a local path or the HF cache, else the Hub, else the bundled
    Llama 3.x values, else the builtin tiny model's."""
    from transformers import AutoConfig, LlamaConfig

    from hf_optim.tiny import BUILTIN_MODEL, TINY_CHAT_SHAPE, bundled_tokenizer, tiny_llama_config

    if model_id == BUILTIN_MODEL:
        return tiny_llama_config(vocab_size=len(bundled_tokenizer()), **TINY_CHAT_SHAPE), "builtin tiny model"
    try:
        return AutoConfig.from_pretrained(model_id, local_files_only=True), "local config"
    except Exception:
        pass
    if _hub_reachable():
        try:
            return AutoConfig.from_pretrained(model_id), "Hub config"
        except Exception:
            pass
    known = known_architecture(model_id)
    if known is None:
        raise LookupError(f"no config for {model_id!r}: not cached locally, the Hub is unreachable, and it is not "
                          f"one of the bundled architectures ({', '.join(KNOWN_ARCHITECTURES)})")
    config = LlamaConfig(**known, rope_theta=500000.0, rms_norm_eps=1e-5)
    return config, "bundled Llama 3.x architecture values (Hub config unreachable or gated)"


def _dtype(name, default: torch.dtype) -> torch.dtype:
    if name in (None, "auto"):
        return default
    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, str(name).removeprefix("torch."))


def _meta_model(config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _apply_lora(model, peft: dict):
    """``model`` with the recipe's LoRA adapters, created on the meta device too (without it peft allocates and
    initialises every adapter in CPU memory: 8.5 s for Llama-3.3-70B's, against 1.3 s)."""
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore", FutureWarning)  # peft calls a transformers API deprecated in 5.x
        return get_peft_model(model, LoraConfig(**{"task_type": "CAUSAL_LM", **peft}))


def meta_peft_model(config, dtype: torch.dtype, peft: dict):
    """The model of ``config`` with LoRA adapters ``peft`` (LoraConfig arguments), all on the meta device: how
    ``validate`` and ``train`` check a peft section (peft's own checks, the target modules) without weights."""
    return _apply_lora(_meta_model(config, dtype), peft)


def estimate(recipe: Recipe) -> MemoryEstimate:
    """The memory estimate of ``recipe`` (see the module docstring). ``auto`` precision counts as bf16, the
    precision of the GPUs the bundled recipes target."""
    model_id = str(recipe.model["id"])
    config, source = load_config(model_id)
    notes = []
    weights_dtype = _dtype(recipe.model.get("dtype", recipe.model.get("torch_dtype")), torch.bfloat16)
    if recipe.model.get("dtype", recipe.model.get("torch_dtype")) in (None, "auto"):
        notes.append("dtype auto counted as bfloat16")
    model = _meta_model(config, weights_dtype)
    total_params = sum(p.numel() for p in model.parameters())
    quantized: set[int] = set()
    if recipe.method == "qlora":
        quantized = _quantized_weights(model, recipe.quantization or {})
    if recipe.peft is not None:
        model = _apply_lora(model, recipe.peft)
        if recipe.method == "qlora":
            # TRL casts QLoRA adapters to bf16; plain LoRA adapters stay fp32 (peft's autocast_adapter_dtype).
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(torch.bfloat16)
    tensors = trainable_tensors(model)
    weights = sum(_quantized_bytes(p, recipe.quantization or {}) if id(p) in quantized else p.numel() * p.element_size()
                  for p in model.parameters())  # parameters() yields a tied weight once
    gradients = sum(t.numel * t.element_size for t in tensors)
    optim = recipe.optim
    state = state_bytes(optim, tensors, recipe.training.get("optim_args"))
    if state is None:
        notes.append(f"no state model for {optim!r}: optimizer state not included")
    elif optim in TORCH_STATE_COUNT and tensors:
        notes.append(f"{optim} keeps torch's state in the parameter dtype ({_dtype_names(tensors)})")
    elif optim in OPTIMIZER_NAMES and OPTIMIZER_NAMES[optim].state_format.quantized:
        fp32 = sum(t.numel for t in tensors if t.embedding or t.numel < MIN_8BIT_SIZE)
        if fp32:
            notes.append(f"{fp32:,} trainable elements keep fp32 state (nn.Embedding weights and tensors under "
                         f"{MIN_8BIT_SIZE} elements)")
    if recipe.method == "qlora":
        notes.append("quantized weights: 4-bit = 0.5 byte each plus constants per block of 64")
    return MemoryEstimate(model_id, source, recipe.method, optim, total_params, sum(t.numel for t in tensors),
                          weights, gradients, state, notes, tensors, config)


def _dtype_names(tensors: list[TensorCount]) -> str:
    sizes = sorted({t.element_size for t in tensors})
    return ", ".join({2: "2 bytes: bf16/fp16", 4: "4 bytes: fp32"}.get(s, f"{s} bytes") for s in sizes)


def _quantized_weights(model, quantization: dict) -> set[int]:
    """ids of the weights bitsandbytes would quantize: every ``nn.Linear`` but the output head and skipped
    modules (transformers keeps the head in full precision)."""
    if not (quantization.get("load_in_4bit") or quantization.get("load_in_8bit")):
        return set()
    skip = set(quantization.get("llm_int8_skip_modules") or []) | {"lm_head"}
    return {id(module.weight) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and not any(part in skip for part in name.split("."))}


def _quantized_bytes(param: torch.Tensor, quantization: dict) -> int:
    """4-bit weights: half a byte each; one absmax per 64 (fp32, or 8-bit with an fp32 absmax per 256 of them).
    8-bit (LLM.int8) weights: a byte each and an fp32 scale per output row."""
    numel = param.numel()
    if not quantization.get("load_in_4bit"):
        return numel + 4 * param.shape[0]
    double_quant = bool(quantization.get("bnb_4bit_use_double_quant"))
    blocks = math.ceil(numel / NF4_BLOCK)
    constants = blocks + 4 * math.ceil(blocks / 256) if double_quant else 4 * blocks
    return math.ceil(numel / 2) + constants
