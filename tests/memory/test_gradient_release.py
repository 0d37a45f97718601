"""Gradient release (``release_gradients=True``): bit-identical to the ordinary step under the Trainer, gradients
freed during backward, and each case it cannot honour refused with a clear error."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from trainer_helpers import assert_same_training_state, common_args, inner_optimizer, losses, token_dataset

import hf_optim
from hf_optim.integrations.transformers import check_release_arguments
from hf_optim.tiny import tiny_llama, tiny_tokenizer

# Every family in every precision it has, and a paged name (paging falls back to ordinary memory on CPU).
NAMES = [
    "adamw_32bit", "adamw_8bit", "adamw_4bit", "paged_adamw_8bit",
    "ademamix_32bit", "ademamix_8bit", "ademamix_4bit",
    "lion_32bit", "lion_8bit", "lion_4bit",
    "rmsprop_bnb_32bit", "rmsprop_8bit",
    "lamb_32bit", "lamb_8bit",
    "adafactor", "adafactor_8bit",
]
RELEASE = "release_gradients=True"


def trainer(tmp_path, name: str, *, release: bool, model=None, seed: int = 0, **overrides):
    """A 10-step run on a 1-layer tiny Llama, the learning rate changing every step (warmup, then linear decay),
    so a hook that used the wrong step's learning rate would show."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    tokenizer = tiny_tokenizer()
    settings = dict(max_steps=10, per_device_train_batch_size=2, max_grad_norm=0.0, weight_decay=0.01,
                    lr_scheduler_type="linear", warmup_steps=3)
    settings.update(overrides)
    if release:
        settings["optim_args"] = ",".join(filter(None, [settings.get("optim_args"), RELEASE]))
    args = TrainingArguments(**common_args(tmp_path, name, **settings))
    model = model if model is not None else tiny_llama(seed=seed, layers=1)
    return Trainer(model=model, args=args, train_dataset=token_dataset(tokenizer, 20),
                   data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))


def grad_norms(run) -> list[float]:
    return [entry["grad_norm"] for entry in run.state.log_history if "grad_norm" in entry]


@pytest.mark.parametrize("name", NAMES)
def test_release_matches_the_ordinary_step_bit_for_bit(tmp_path, name):
    ordinary = trainer(tmp_path / "ordinary", name, release=False)
    ordinary.train()
    released = trainer(tmp_path / "released", name, release=True)
    released.train()
    optimizer = inner_optimizer(released)
    assert optimizer.release_gradients and not inner_optimizer(ordinary).release_gradients
    assert losses(released) == losses(ordinary) and len(losses(ordinary)) == 10
    assert_same_training_state(ordinary, released)
    assert all(p.grad is None for p in released.model.parameters())
    # The logged grad_norm is the norm of the released gradients (the Trainer would find none and log 0).
    assert grad_norms(released) == pytest.approx(grad_norms(ordinary), rel=1e-5)
    assert min(grad_norms(released)) > 0


@pytest.mark.parametrize("name", ["adamw_4bit", "lamb_8bit"])
def test_bf16_weights_with_stochastic_rounding_match_bit_for_bit(tmp_path, name):
    """bf16 weights, rounded stochastically: the per-parameter hooks draw each tensor's own random bits."""
    runs = []
    for release in (False, True):
        model = tiny_llama(layers=1).to(torch.bfloat16)
        run = trainer(tmp_path / str(release), name, release=release, model=model, max_steps=5,
                      optim_args="bf16_stochastic_round=True")
        run.train()
        runs.append(run)
    assert all(p.dtype == torch.bfloat16 for p in runs[1].model.parameters())
    assert losses(runs[0]) == losses(runs[1])
    assert_same_training_state(*runs)


def test_gradient_checkpointing_matches_bit_for_bit(tmp_path):
    """With activation checkpointing each layer's gradients come from a recomputation inside backward: the hooks
    still fire once per parameter."""
    runs = []
    for release in (False, True):
        run = trainer(tmp_path / str(release), "adamw_8bit", release=release, max_steps=4,
                      model=tiny_llama(layers=2), gradient_checkpointing=True)
        run.train()
        runs.append(run)
    assert losses(runs[0]) == losses(runs[1])
    assert_same_training_state(*runs)


def test_at_most_one_gradient_is_alive_during_backward(tmp_path):
    """A counting hook, registered before the optimizer's, sees how many gradients exist each time backward
    finishes one: with release it is only the one just produced; without, they pile up to all of them."""
    def run(release: bool) -> tuple[int, int]:
        model = tiny_llama(layers=2)
        params = [p for p in model.parameters() if p.requires_grad]
        alive = []
        for p in params:
            p.register_post_accumulate_grad_hook(
                lambda _: alive.append(sum(q.grad is not None for q in params)))
        trainer(tmp_path / str(release), "adamw_8bit", release=release, model=model, max_steps=2).train()
        return max(alive), len(params)

    most, count = run(release=True)
    assert most == 1
    most, count = run(release=False)
    assert most == count > 10


def test_frozen_parameters_get_no_hook_and_no_state(tmp_path):
    def frozen_model():
        model = tiny_llama(layers=1)
        model.model.embed_tokens.weight.requires_grad_(False)
        for p in model.model.layers[0].self_attn.parameters():
            p.requires_grad_(False)
        return model

    ordinary = trainer(tmp_path / "ordinary", "adamw_4bit", release=False, model=frozen_model())
    ordinary.train()
    model = frozen_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    released = trainer(tmp_path / "released", "adamw_4bit", release=True, model=model)
    released.train()
    optimizer = inner_optimizer(released)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert optimizer._release.hooked == len(trainable) < len(list(model.parameters()))
    assert set(map(id, optimizer.state)) == set(map(id, trainable))
    for name, p in model.named_parameters():
        if name in before:
            assert torch.equal(p, before[name]) and p.grad is None, name
    assert_same_training_state(ordinary, released)


def test_exact_resume_with_release(tmp_path):
    """A run resumed from its step-4 checkpoint ends on the same weights and state as the uninterrupted run."""
    settings = dict(save_strategy="steps", save_steps=4, max_steps=8)
    straight = trainer(tmp_path, "lamb_8bit", release=True, **settings)
    straight.train()
    resumed = trainer(tmp_path, "lamb_8bit", release=True, seed=1, **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    assert inner_optimizer(resumed).release_gradients
    assert losses(resumed) == losses(straight) and len(losses(straight)) == 8  # the first 4 from the checkpoint
    assert_same_training_state(straight, resumed)


@pytest.mark.parametrize(("overrides", "named"), [
    (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps=2"),
    (dict(max_grad_norm=1.0), "max_grad_norm=1.0"),
])
def test_trainer_refuses_what_release_cannot_honour(tmp_path, overrides, named):
    run = trainer(tmp_path, "adamw_8bit", release=True, **overrides)
    with pytest.raises(ValueError, match=named) as error:
        run.train()
    assert "release_gradients=True" in str(error.value)


def test_user_built_optimizer_is_checked_too(tmp_path):
    """An optimizer passed to the Trainer ready-made, with the Trainer's default max_grad_norm=1.0."""
    from transformers import Trainer, TrainingArguments

    model = tiny_llama(layers=1)
    args = TrainingArguments(**common_args(tmp_path, "adamw_torch", max_steps=1))
    optimizer = hf_optim.AdamW8bit(model.parameters(), release_gradients=True)
    run = Trainer(model=model, args=args, train_dataset=token_dataset(tiny_tokenizer(), 4),
                  optimizers=(optimizer, None))
    with pytest.raises(ValueError, match="max_grad_norm=1.0"):
        run.train()


@pytest.mark.parametrize(("setting", "named"), [
    (dict(fp16=True), "GradScaler"),
    (dict(fsdp="full_shard"), "fsdp='full_shard'"),
    (dict(deepspeed="ds.json"), "deepspeed"),
    (dict(world_size=4), "4 processes"),
])
def test_mixed_precision_and_distributed_arguments_are_refused(setting, named):
    args = SimpleNamespace(gradient_accumulation_steps=1, max_grad_norm=0.0, fp16=False, fsdp="", deepspeed=None,
                           world_size=1)
    check_release_arguments(args)  # nothing to refuse
    with pytest.raises(ValueError, match=named):
        check_release_arguments(SimpleNamespace(**{**vars(args), **setting}))


def small_model_and_batches(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))
    batches = [torch.randn(16, 64) for _ in range(4)]
    return model, batches


def test_a_second_backward_before_step_is_refused():
    """Gradient accumulation outside the Trainer: the second gradient of a parameter would be applied on its own."""
    model, batches = small_model_and_batches()
    optimizer = hf_optim.AdamW8bit(model.parameters(), release_gradients=True)
    model(batches[0]).square().mean().backward()
    with pytest.raises(RuntimeError, match="second gradient before optimizer.step"):
        model(batches[1]).square().mean().backward()
    assert all(state["step"] == 1 for state in optimizer.state.values())  # no parameter stepped twice


def test_plain_loop_and_a_parameter_without_a_hook():
    """In a plain loop: step() after the hooks changes nothing more; a parameter frozen when the optimizer was built
    (no hook) and trained later keeps its gradient for step(), as with the ordinary optimizer; a parameter given a
    gradient again after its hook stepped it is refused at step(); removing the hooks gives the ordinary optimizer."""
    model, batches = small_model_and_batches()
    twin = copy.deepcopy(model)
    for net in (model, twin):
        net[0].bias.requires_grad_(False)
    released = hf_optim.Lion8bit(model.parameters(), lr=1e-3, min_8bit_size=64, release_gradients=True)
    ordinary = hf_optim.Lion8bit(twin.parameters(), lr=1e-3, min_8bit_size=64)
    for step, x in enumerate(batches):
        for net, optimizer in ((model, released), (twin, ordinary)):
            if step == 2:
                net[0].bias.requires_grad_(True)
            optimizer.zero_grad()
            net(x).square().mean().backward()
            optimizer.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert released.state[model[0].bias]["step"] == 2
    assert released.released_grad_norm is None  # nothing released since the last step()

    model(batches[0]).square().mean().backward()
    model[2].weight.grad = torch.ones_like(model[2].weight)
    before = model[2].weight.detach().clone()
    with pytest.raises(RuntimeError, match="already stepped"):
        released.step()
    assert torch.equal(model[2].weight, before)
    released.zero_grad()
    released.step()
    released.remove_release_hooks()
    model(batches[0]).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bad_value_and_sharded_parameters_are_refused(monkeypatch):
    model, _ = small_model_and_batches()
    with pytest.raises(TypeError, match="release_gradients must be True or False"):
        hf_optim.AdamW(model.parameters(), release_gradients="yes")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="2 ranks"):
        hf_optim.AdamW(model.parameters(), release_gradients=True)


def test_pickled_optimizer_keeps_releasing():
    model, batches = small_model_and_batches()
    optimizer = hf_optim.RMSprop(model.parameters(), lr=1e-3, release_gradients=True)
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))
    assert optimizer_copy.release_gradients
    model_copy(batches[0]).square().mean().backward()
    assert all(p.grad is None for p in model_copy.parameters())
    assert all(optimizer_copy.state[p]["step"] == 1 for p in model_copy.parameters())


def test_recipe_validation_names_what_release_cannot_honour():
    from hf_optim.recipes import RecipeError, load_recipe

    args = "training.optim_args=bf16_stochastic_round=true,release_gradients=true"
    with pytest.raises(RecipeError, match="max_grad_norm=1.0") as error:
        load_recipe("llama-3.1-8b-full", [args, "training.gradient_accumulation_steps=4"])
    assert "gradient_accumulation_steps=4" in str(error.value)
    recipe = load_recipe("llama-3.1-8b-full", [args, "training.max_grad_norm=0"])
    assert "release_gradients=true" in recipe.training["optim_args"]
