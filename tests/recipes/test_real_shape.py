"""``hf-optim train RECIPE --random-weights`` on a tiny Llama architecture (hf_optim.recipes.real_shape).

The recipe is the bundled 1B LoRA recipe with ``model.id`` pointing at a directory that holds only a config.json (no
weights): the mode builds the model from the architecture alone. The architecture's vocabulary (4096) is larger than
the bundled tokenizer's, so the embedding must keep the architecture's size. Checked against independent sources:

- weights, adapters, gradients and optimizer state measured from the tensors themselves equal the planner's counts
  (hf_optim.recipes.estimate, which builds the model on the meta device and prices the state from the algorithm's
  description) exactly: both count the same elements and bytes, so any difference is a bug on one side;
- the 8-bit state is really 8-bit (uint8 state tensors present): LoRA r16 on a 256-wide model gives 4096-element
  adapter matrices, the smallest that 8-bit optimizers quantize;
- the loss is finite and goes down over three steps (a random-init model; lr 3e-4 without warmup);
- the measured peak of tensor bytes is within 15% of the planner's estimate: the issue's target for this mode.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_optim.recipes import real_shape
from hf_optim.tiny import bundled_tokenizer, tiny_llama_config

PEAK_TOLERANCE = 0.15  # issue 34's target for the planner against a random-weights run
VOCAB = 4096  # larger than the bundled tokenizer (768): the embedding keeps the architecture's size


@pytest.fixture
def tiny_recipe(tmp_path):
    arch = tmp_path / "tiny-arch"
    tiny_llama_config(vocab_size=VOCAB, hidden_size=256, layers=2, heads=4, kv_heads=2, intermediate_size=768,
                      max_positions=512).save_pretrained(arch)
    recipe = tmp_path / "tiny-lora.yaml"
    recipe.write_text(f"extends: llama-3.2-1b-lora\nmodel:\n  id: {arch}\npeft:\n  r: 16\n  lora_alpha: 16\n")
    return recipe


def test_random_weights_run_measures_what_the_planner_estimates(tiny_recipe, tmp_path):
    assert len(bundled_tokenizer()) < VOCAB
    out = tmp_path / "run"
    options = real_shape.check_options(steps=3, seq_len=128, batch_size=2)
    result = real_shape.train(tiny_recipe, ["training.gradient_accumulation_steps=1"], options, out, quiet=True)

    assert result.status == "ok"
    data = json.loads((out / real_shape.MEMORY_FILE).read_text())
    assert data == json.loads(json.dumps(result.memory))
    assert not list(out.glob("*.safetensors")), "random weights are not saved"
    assert (data["seq_len"], data["batch_size"], data["device"]) == (128, 2, "cpu")
    parts = data["components"]
    for name in ("weights", "adapters", "gradients", "optimizer_state"):
        assert parts[name]["measured_bytes"] == parts[name]["estimate_bytes"], (name, parts[name])
    assert parts["weights"]["measured_bytes"] > VOCAB * 256 * 4  # the fp32 embedding alone has 4096 rows
    assert "uint8" in result.state.by_dtype, result.state.by_dtype
    assert result.optimizer == "hf_optim.AdamW8bit"

    losses = data["losses"]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0], losses

    peak = parts["peak"]
    assert abs(peak["measured_bytes"] - peak["estimate_bytes"]) <= PEAK_TOLERANCE * peak["estimate_bytes"], peak
    assert torch.get_default_dtype() == torch.float32


def test_random_weights_options_are_checked_in_one_line():
    from hf_optim.recipes.errors import RecipeError

    with pytest.raises(RecipeError, match="--seq-len: must be a positive integer, got 0"):
        real_shape.check_options(steps=None, seq_len=0, batch_size=None)


def test_a_random_weights_run_takes_one_batch_per_step_unless_told_and_says_what_it_runs():
    """Issue 43: the 1B LoRA recipe's ``gradient_accumulation_steps: 8`` still applied, so on a CPU no step ended
    within 580 s, and nothing said so. The run's first line names its steps, shape and accumulation."""
    options = real_shape.check_options(steps=3, seq_len=64, batch_size=None)
    recipe = real_shape.load("llama-3.2-1b-lora", [], options)
    assert recipe.training["gradient_accumulation_steps"] == 1
    assert recipe.notes[-1] == (
        "random-weights mode: meta-llama/Llama-3.2-1B-Instruct built from its architecture with random weights, "
        "bundled tokenizer and data; 3 steps of batch 4 x 64 tokens, gradient accumulation 1 (the recipe's 8 is not "
        "applied: training.gradient_accumulation_steps=8 applies it); no warmup, evaluation, checkpoint or saved "
        "model")
    asked = real_shape.load("llama-3.2-1b-lora", ["training.gradient_accumulation_steps=8"], options)
    assert asked.training["gradient_accumulation_steps"] == 8
    assert "3 steps of batch 4 x 64 tokens, gradient accumulation 8 (command line);" in asked.notes[-1]


def test_the_progress_detail_follows_the_step_layer_by_layer_through_checkpointed_forward_and_backward():
    """What the progress bar shows during a long step comes from hooks on the real decoder layers, also when
    gradient checkpointing recomputes each layer's forward in the backward."""
    from transformers import TrainerControl, TrainerState

    from hf_optim.tiny import tiny_llama

    model = tiny_llama(layers=3)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    probe = real_shape.probe(torch.device("cpu"), checkpointing=True)
    probe.on_train_begin(None, TrainerState(), TrainerControl(), model=model)
    seen = []
    for layer in real_shape.decoder_layers(model):  # registered after the probe's: they see its count
        layer.register_forward_pre_hook(lambda module, args: seen.append(probe.progress_detail()))
        layer.register_full_backward_pre_hook(lambda module, grads: seen.append(probe.progress_detail()))
    assert probe.progress_detail() is None  # no step yet
    probe.on_step_begin(None, TrainerState(global_step=4), TrainerControl())
    ids = torch.randint(0, 512, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert seen == [f"step 5: forward {i}/3 layers" for i in (1, 2, 3)] + \
        [f"step 5: backward {i}/3 layers" for i in (1, 2, 3)]
    probe.on_pre_optimizer_step(None, TrainerState(global_step=4), TrainerControl())
    assert probe.progress_detail() == "step 5: optimizer step"
    probe.on_train_end(None, TrainerState(), TrainerControl())


def test_the_progress_bar_is_redrawn_with_the_step_detail_while_a_step_runs():
    """A bar redrawn only when a step ends looks frozen (``0/3 [00:00<?, ?it/s]``) for a step of minutes: the
    ticker redraws it, with the clock and the detail of the step under way."""
    import io
    import time

    from tqdm import tqdm

    from hf_optim.recipes.console import ticking

    class Progress:
        loss_text = "loss=12.13"
        training_bar = tqdm(total=3, file=io.StringIO(), mininterval=0)

    with ticking(Progress, detail=lambda: "step 2: forward 7/16 layers", every=0.05):
        time.sleep(0.6)
    drawn = Progress.training_bar.fp.getvalue()
    Progress.training_bar.close()
    redraws = drawn.split("\r")
    assert sum("loss=12.13, step 2: forward 7/16 layers" in part for part in redraws) >= 3, drawn
