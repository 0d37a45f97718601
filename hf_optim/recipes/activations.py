"""An estimate of activation memory for Llama-shaped decoders, per token, with and without gradient checkpointing.

Why a formula of our own rather than Korthikanti et al. (2022)'s ``34h + 5as`` per layer per token: that one
counts a Megatron GPT layer in fp16 with the attention matrix materialised (the ``5as`` term) and dropout masks.
A Hugging Face Llama trained with SDPA (flash or memory-efficient attention) has neither, but it has SwiGLU (three
MLP matrices) and RMSNorm, which upcasts its input to fp32 and keeps that copy for backward. Counting the tensors
the HF Llama layer saves for backward, with ``e`` the bytes of an activation element (2 for bf16/fp16), ``h`` the
hidden size, ``i`` the MLP width, ``a`` the attention heads and ``h_kv`` the key/value width, gives per token:

* each RMSNorm: the fp32 copy of its input ``4h``, the normalised value ``e*h``, its output (the next linear
  layers' input) ``e*h``, and one fp32 reciprocal RMS ``4``;
* attention: q ``e*h``, k and v after RoPE ``2*e*h_kv`` (GQA keeps them unrepeated), the output ``e*h`` (also
  ``o_proj``'s input), and SDPA's fp32 log-sum-exp per head ``4a``;
* SwiGLU: gate, up, silu(gate) and their product, ``4*e*i``;

so a layer is ``2*(4h + 2eh + 4) + e*(2h + 2h_kv) + 4a + 4ei`` bytes per token (``20h + 4h_kv + 8i + 4a + 8`` in
bf16). Around the layers: the final RMSNorm (as above), the fp32 log-softmax of the logits ``4V`` (transformers
upcasts logits before the cross-entropy) and the int64 input ids and labels ``16``.

With gradient checkpointing each layer keeps only its input ``e*h`` and is recomputed in backward, so one layer's
full activations come back at a time.

The peak is not only the saved tensors: at the start of backward the loss head holds two fp32 logit-sized gradients
``8V`` besides its saved log-softmax, and gradients build up while activations are
freed. :func:`backward_peak_bytes` walks the backward stage by stage (head, then each layer from the last one) and
takes the largest sum of what is alive, with all gradients kept or with gradient release (a released gradient is
freed once its parameter has stepped: see :func:`backward_peak_bytes`; nothing is released before backward has made
a gradient, so at the loss head, where a long sequence's peak often is, release saves nothing).

Calibrated in ``tests/recipes/test_activation_estimate.py`` against the tensors a CPU forward of the tiny model really
saves
(``torch.autograd.graph.saved_tensors_hooks``) and against the peak of the CPU allocator's own allocation events
(``torch.profiler`` with ``profile_memory=True``) over a forward and backward. Not counted: a padded batch's
attention mask (we assume unpadded or packed sequences, ``is_causal`` attention), attention without
flash/memory-efficient kernels (``eager`` keeps an ``s x s`` matrix per head), kernel workspaces, and metrics a
trainer computes from the logits. It is an estimate, and the planner says so.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32 = 4
INDEX_BYTES = 16  # int64 input ids (kept by the embedding's backward) and int64 labels (kept by the loss)


@dataclass(frozen=True)
class DecoderShape:
    """What the activation estimate needs of a Llama-shaped decoder's config, and the gradients it produces.

    Attributes:
        hidden: hidden size ``h``.
        intermediate: MLP width ``i``.
        layers: decoder layers.
        heads: attention heads ``a``.
        kv_width: key/value width ``h_kv`` (kv heads times head dim).
        vocab: vocabulary size ``V``.
        tied: whether the output head shares the input embedding.
        element_size: bytes of an activation (and gradient) element: 2 for bf16/fp16, 4 for fp32.
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_width: int
    vocab: int
    tied: bool
    element_size: int = 2

    @classmethod
    def from_config(cls, config, element_size: int = 2) -> DecoderShape:
        """The shape of a transformers ``LlamaConfig`` (or any config with the same fields)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.hidden_size, config.intermediate_size, config.num_hidden_layers, heads, kv_heads * head_dim,
                   config.vocab_size, bool(getattr(config, "tie_word_embeddings", False)), element_size)

    # -- saved for backward, per token ---------------------------------------------------------------------------
    def norm_bytes(self) -> int:
        """One RMSNorm and its output: fp32 input copy, normalised value, output, reciprocal RMS."""
        return FP32 * self.hidden + 2 * self.element_size * self.hidden + FP32

    def layer_bytes(self) -> int:
        """One decoder layer's saved tensors per token, without checkpointing (see the module docstring)."""
        e = self.element_size
        attention = e * (2 * self.hidden + 2 * self.kv_width) + FP32 * self.heads
        return 2 * self.norm_bytes() + attention + 4 * e * self.intermediate

    def head_bytes(self) -> int:
        """Saved outside the layers: final norm, fp32 log-softmax of the logits, input ids and labels."""
        return self.norm_bytes() + FP32 * self.vocab + INDEX_BYTES

    def saved_bytes(self, checkpointing: bool) -> int:
        """Everything saved for backward at the end of the forward, per token."""
        per_layer = self.element_size * self.hidden if checkpointing else self.layer_bytes()
        return self.layers * per_layer + self.head_bytes()

    def head_transient_bytes(self) -> int:
        """Alive only while the loss is differentiated: two fp32 logit-sized gradients (the loss's and the
        log-softmax's). A trainer that still holds the model's outputs keeps the logits too (``e*V``): the
        Trainer does not."""
        return 2 * FP32 * self.vocab

    def layer_transient_bytes(self) -> int:
        """Alive while a layer is differentiated, besides what it saved: the gradient of its output and, in the
        MLP's backward, the gradients of the down projection's input, of silu(gate) and of up."""
        return self.element_size * (self.hidden + 3 * self.intermediate)

    # -- gradients --------------------------------------------------------------------------------------------------
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q, k, v, o, gate, up, down and two norm weights."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_width + 3 * h * self.intermediate + 2 * h

    def released_gradient_bytes(self) -> int:
        """Gradient bytes alive at once with gradient release, at most (at the embedding's backward; the out-of-place
        sum of a tied weight's two contributions, a moment's copy, is a transient of that stage). Each hook steps
        its parameter and frees the gradient as soon as backward has made it, except a tied weight's: autograd holds
        the output head's contribution until the embedding's arrives, and only then is that gradient complete. So:
        tied, the held contribution and the embedding's dense gradient; untied, the embedding's (the output head's
        was stepped and freed before the layers' backward). Measured on CPU in
        ``tests/recipes/test_activation_estimate.py``."""
        embedding = self.element_size * self.vocab * self.hidden
        return 2 * embedding if self.tied else embedding


def backward_peak_bytes(shape: DecoderShape, tokens: int, checkpointing: bool, release: bool) -> int:
    """Peak of activations + gradients during one forward and backward over ``tokens`` tokens (weights and
    optimizer state excluded).

    Stages, from the first one backward reaches: the loss head (all saved tensors and the head's transients; no
    gradient exists yet), the output head (its weight's gradient is made), then each layer from the last (saved
    tensors of the layers not yet reached, with checkpointing that layer's recomputed activations, and the gradients
    alive), then the embedding. Gradients kept: they accumulate. Gradient release (:mod:`hf_optim.optim.release`):
    a gradient lives from the moment backward makes it until its parameter's hook has stepped it, so between hooks
    only a tied weight's gradient is alive (:meth:`DecoderShape.released_gradient_bytes`). Release only ever frees:
    no stage is higher released than kept.
    """
    e = shape.element_size
    head_grad = e * shape.vocab * shape.hidden
    layer_grad = e * shape.layer_params()
    held = head_grad if release and shape.tied else 0  # see released_gradient_bytes
    base = tokens * INDEX_BYTES  # input ids and labels stay to the end
    per_layer_saved = tokens * (e * shape.hidden if checkpointing else shape.layer_bytes())
    saved = tokens * shape.saved_bytes(checkpointing)
    loss_stage = saved + tokens * shape.head_transient_bytes()
    # the output head's backward: the fp32 log-softmax is gone, the logits' gradient is in the activation dtype; the
    # head's weight gradient exists in both modes (released, untied, its hook frees it before the layers' backward)
    head_stage = saved - tokens * (FP32 - e) * shape.vocab + head_grad
    peaks = [loss_stage, head_stage]
    for remaining in range(shape.layers, 0, -1):  # backward through layer ``remaining`` (1-based)
        alive = base + remaining * per_layer_saved + tokens * shape.layer_transient_bytes()
        if checkpointing:
            alive += tokens * shape.layer_bytes()
        # the layer's own gradients come at the end of its backward, as its activations go
        grads = held if release else head_grad + (shape.layers - remaining) * layer_grad
        peaks.append(alive + grads)
    total_grads = head_grad + shape.layers * layer_grad + e * shape.hidden + (0 if shape.tied else head_grad)
    # the embedding's backward makes a dense gradient; tied, it is added to the output head's out of place, so
    # three embedding-sized gradients exist for a moment (measured on CPU)
    tied_sum = 2 * head_grad if shape.tied else 0
    embedding_grads = (held + head_grad + (head_grad if shape.tied else 0)) if release else total_grads + tied_sum
    peaks.append(base + tokens * e * shape.hidden + embedding_grads)
    return max(peaks)


# -- a whole training step as ``hf-optim train`` runs it (TRL's SFTTrainer) -------------------------------------------
# The estimate above models the model's own loss (full logits, fp32 log-softmax). TRL's SFTTrainer (1.x) replaces it
# with a chunked LM head (``trl.trainer.utils.add_fused_lm_head``): the logits are never materialised; the head is
# projected in tiles of at most TOKEN_TILE tokens x VOCAB_TILE vocabulary entries, and its backward recomputes each
# tile. What that head keeps and makes is counted by :class:`LossHead`; the peak of a step by
# :func:`training_peak_bytes`, for a full fine-tune or LoRA/QLoRA adapters.

TOKEN_TILE = 4096  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE
VOCAB_TILE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE
TORCH_BACKWARD_TILES = 7.25
"""fp32 tile-sized tensors alive at once in the backward of TRL's chunked head without Triton (CPU): its
``_backward_tile`` holds y, z, log_p, p and grad, plus, while it adds the log-prob term, ``is_target.float() - p``
and then its product by the incoming gradient (the ``float()`` copy is freed as the subtraction returns), and
``is_target`` itself (bool: a quarter of an fp32 tile). Measured on CPU: 7.25 tiles besides the mm buffer, for
vocabularies of one and of two tiles. The mm buffer is ``TOKEN_TILE x VOCAB_TILE`` wide whatever the vocabulary (a
model with fewer than 32768 tokens still gets a 32768-wide buffer). With Triton (CUDA) the tile is folded in place:
only the mm buffer."""


@dataclass(frozen=True)
class LossHead:
    """The LM head and loss of a training step.

    Attributes:
        fused: TRL's chunked head (see above) instead of the model's logits and cross-entropy.
        torch_tiles: the fused head folds its tiles with torch ops (no Triton: CPU), making the temporaries of
            :data:`TORCH_BACKWARD_TILES`.
        trainable: the head's weight trains (a full fine-tune), so its backward accumulates an fp32 weight gradient.
        compute_size: bytes of an element of the head's projection (the autocast or model dtype).
    """

    fused: bool = True
    torch_tiles: bool = False
    trainable: bool = True
    compute_size: int = 2


@dataclass(frozen=True)
class Adapters:
    """LoRA adapters on some linear layers of each decoder layer.

    Attributes:
        rank: LoRA rank ``r``.
        in_features: the input width of each adapted linear layer of one decoder layer.
        element_size: bytes of an adapter element (4: fp32 adapters; 2: QLoRA's bf16 ones).
        quantized_weight: elements of the largest 4-bit base weight (QLoRA), which bitsandbytes dequantizes, one at
            a time, in each forward and backward of its layer; 0 when the base is not quantized.
    """

    rank: int
    in_features: tuple[int, ...]
    element_size: int
    quantized_weight: int = 0

    def saved_per_token(self, activation_size: int) -> int:
        """What the adapters of one layer add to its saved tensors, per token: the rank-wide output of each A
        (B's input, kept for B's gradient) and, when the adapters' dtype differs from the activations', the copy of
        each input that peft casts to it (autocast casts an fp32 copy back to the compute dtype: the smaller one
        is what is kept)."""
        cast = min(activation_size, self.element_size) if self.element_size != activation_size else 0
        return sum(self.rank * self.element_size + cast * width for width in self.in_features)


def training_peak_bytes(shape: DecoderShape, tokens: int, checkpointing: bool, head: LossHead,
                        adapters: Adapters | None = None, gradient_bytes: int | None = None,
                        accumulating: bool = False) -> int:
    """Peak of activations + gradients during one forward and backward over ``tokens`` tokens, as TRL's
    SFTTrainer runs it (weights and optimizer state excluded).

    Args:
        shape: the decoder.
        tokens: tokens of the micro-batch (batch x sequence length).
        checkpointing: gradient checkpointing (each layer keeps its input and is recomputed in backward).
        head: the LM head and loss (:class:`LossHead`).
        adapters: LoRA/QLoRA adapters (None: a full fine-tune, every weight trains).
        gradient_bytes: all gradients of the step (LoRA: the adapters'); None: the full fine-tune's, from the shape.
        accumulating: gradient accumulation over several micro-batches: every gradient is alive from the start.

    Stages, as in :func:`backward_peak_bytes`: the loss head's backward, each layer's backward from the last, the
    embedding. Gradients kept (not released); a LoRA layer's gradients count when its backward ends.
    """
    e = shape.element_size
    full = adapters is None
    head_grad = e * shape.vocab * shape.hidden if full else 0
    layer_grad = e * shape.layer_params() if full else (gradient_bytes or 0) // shape.layers
    total_grads = gradient_bytes if gradient_bytes is not None else \
        head_grad + shape.layers * layer_grad + e * shape.hidden + (0 if shape.tied else head_grad)
    layer_saved = shape.layer_bytes() + (adapters.saved_per_token(e) if adapters else 0)
    per_layer_kept = tokens * (e * shape.hidden if checkpointing else layer_saved)
    base = tokens * INDEX_BYTES
    dequantized = adapters.quantized_weight * e if adapters else 0
    if head.fused:
        # final norm, the hidden copy the head keeps, fp32 log_z and entropy, int64 targets; then, in the head's
        # backward: the fp32 gradient of the hidden states, the tile buffers and (full fine-tune) an fp32 weight
        # gradient that becomes one in the weights' dtype at the end
        kept = base + shape.layers * per_layer_kept + tokens * (shape.norm_bytes() + e * shape.hidden + 16)
        rows = min(tokens, TOKEN_TILE)
        tiles = rows * VOCAB_TILE * head.compute_size  # the mm buffer
        if head.torch_tiles:
            tiles += int(TORCH_BACKWARD_TILES * rows * min(shape.vocab, VOCAB_TILE) * FP32)
        weight_grad = shape.vocab * shape.hidden * (FP32 + e) if head.trainable else 0
        head_stage = kept + tokens * FP32 * shape.hidden + tiles + weight_grad
    else:
        kept = base + shape.layers * per_layer_kept + tokens * shape.head_bytes()
        head_stage = kept + tokens * shape.head_transient_bytes() + (head_grad if full else 0)
    grads = total_grads if accumulating else (head_grad if full else 0)
    peaks = [head_stage + (total_grads if accumulating else 0)]
    for remaining in range(shape.layers, 0, -1):
        alive = base + remaining * per_layer_kept + tokens * shape.layer_transient_bytes() + dequantized
        if checkpointing:
            alive += tokens * layer_saved
        if not accumulating:
            grads = (head_grad if full else 0) + (shape.layers - remaining) * layer_grad
        peaks.append(alive + grads)
    tied_sum = 2 * head_grad if shape.tied else 0
    peaks.append(base + tokens * e * shape.hidden + total_grads + tied_sum)
    return max(peaks)
