"""Muon (hf_optim.optim.muon): torch.optim.Muon's math with the momentum in every state format, the AdamW rule of
its non-Muon parameters, state dicts, refusals, the estimator, and routing a model's parameters for the Trainer.

What the conformance suite (tests/algorithms/test_algorithm_conformance.py) checks for every algorithm (format bounds
of the momentum slot, exact resume per format, state bytes) is not repeated here.
"""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import make_params, set_grads
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

import hf_optim
from hf_optim.formats.base import StateDictError
from hf_optim.integrations.transformers import optimizer_cls_and_kwargs
from hf_optim.optim.muon import (
    MUON_ROUTE_ATTR,
    NS_COEFFICIENTS,
    Muon,
    Muon8bit,
    adjusted_lr,
    newton_schulz,
    route_model,
)
from hf_optim.recipes.estimate import TensorCount, state_bytes

TESTS = Path(__file__).resolve().parents[1]
MATRICES = [(64, 32), (64, 32), (32, 96), (4100, 3), (48, 48)]
"""Tall, wide and square matrices; two of one shape (batched together); one with 12300 elements (quantized)."""
STEPS = 6
FP32_ULP = 2.0**-23


def run(opt, params, steps, start=0):
    for step in range(start, start + steps):
        set_grads(params, step)
        opt.step()


def clones(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def build(cls, params, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged classes on CPU
        return cls(params, **kwargs)


# --------------------------------------------------------------------------------------------------------------
# 32-bit against torch.optim.Muon
@pytest.mark.parametrize("shape", [(64, 32), (32, 96), (48, 48), (4100, 3)])
def test_batched_newton_schulz_equals_torch_per_matrix_bit_for_bit(shape):
    updates = torch.randn(3, *shape, generator=torch.Generator().manual_seed(1))
    batched = newton_schulz(updates, NS_COEFFICIENTS, 5, 1e-7)
    for update, got in zip(updates, batched):
        assert torch.equal(got, _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, 5, 1e-7))


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw"])
def test_adjusted_lr_is_torchs(fn):
    for shape in MATRICES:
        assert adjusted_lr(0.02, fn, shape) == _adjust_lr(0.02, fn, torch.Size(shape))


CONFIGS = [
    {},
    {"lr": 0.02, "nesterov": False, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.05},
    {"lr": 0.01, "momentum": 0.9, "adjust_lr_fn": "original", "ns_steps": 3, "weight_decay": 0.0},
]


@pytest.mark.parametrize("config", CONFIGS, ids=["defaults", "match_rms_adamw", "original-ns3"])
def test_32bit_follows_torch_optim_muon(config):
    """The momentum within 2 fp32 ulps of its size per step (torch's CPU ``lerp`` rounds once through a fused
    multiply-add; hf_optim's rule rounds each operation so its eager, compiled and Triton paths agree: measured
    1 ulp), and the parameters within one bf16 ulp of the orthogonalized update per step (that ulp can flip the bf16
    rounding of a Newton-Schulz input; measured 0.0048 x adjusted lr after 10 steps on 128x128 and 300x700; most
    matrices stay equal bit for bit). The Newton-Schulz and update code is torch's own (the test above)."""
    params = make_params(MATRICES, seed=3)
    reference = clones(params)
    ours = Muon(params, **config)
    theirs = torch.optim.Muon(reference, **config)
    run(ours, params, STEPS)
    run(theirs, reference, STEPS)
    for p, q in zip(params, reference):
        buf, ref_buf = ours.state[p]["state1"], theirs.state[q]["momentum_buffer"]
        assert (buf - ref_buf).abs().max() <= 2 * STEPS * FP32_ULP * ref_buf.abs().max()
        step_lr = adjusted_lr(config.get("lr", 1e-3), config.get("adjust_lr_fn"), tuple(p.shape))
        assert (p - q).abs().max() <= STEPS * step_lr * 2.0**-7, tuple(p.shape)


def test_release_gradients_steps_each_matrix_as_step_does():
    params = make_params(MATRICES)
    released = clones(params)
    plain = Muon(params, lr=0.02)
    hooked = Muon(released, lr=0.02, release_gradients=True)
    for step in range(3):
        set_grads(params, step)
        plain.step()
        for p, q in zip(params, released):  # the hook steps q when its gradient is accumulated
            q.grad = None
            (q * p.grad).sum().backward()
        hooked.step()
    for p, q in zip(params, released):
        assert torch.equal(p, q)


def test_bf16_parameters_round_stochastically_around_the_fp32_update():
    """bf16 matrices with ``bf16_stochastic_round``: each new value is one of the two bf16 neighbours of the update
    computed in fp32 (an fp32 twin from the same values and gradient), and not always the nearest."""
    params = make_params([(96, 64)], dtype=torch.bfloat16)
    twin = [torch.nn.Parameter(params[0].detach().float())]
    opt = Muon(params, lr=0.02, bf16_stochastic_round=True)
    set_grads(params, 0)
    twin[0].grad = params[0].grad.float()
    opt.step()
    Muon(twin, lr=0.02).step()
    exact, got = twin[0].detach(), params[0].detach().float()
    nearest = exact.bfloat16()
    toward = torch.where(nearest.float() > exact, torch.tensor(-math.inf), torch.tensor(math.inf)).bfloat16()
    other = torch.nextafter(nearest, toward).float()
    assert bool(((got == nearest.float()) | ((got == other) & (nearest.float() != exact))).all())
    assert not torch.equal(got, nearest.float())


def test_a_non_finite_gradient_element_leaves_its_momentum_and_the_rest_finite():
    params = make_params([(40, 30)])
    opt = Muon(params, lr=0.02)
    set_grads(params, 0)
    params[0].grad[3, 4] = float("nan")
    opt.step()
    assert torch.isfinite(params[0]).all() and opt.state[params[0]]["state1"][3, 4] == 0


# --------------------------------------------------------------------------------------------------------------
# 8-bit and 4-bit momentum against 32-bit
@pytest.mark.parametrize("fmt,cosine,relative", [("blockwise8", 0.999, 0.03), ("blockwise4", 0.98, 0.25),
                                                 ("fp8", 0.999, 0.06)])
def test_low_bit_momentum_moves_the_parameters_as_32bit_does(fmt, cosine, relative):
    """Over 8 steps at lr 0.02 the parameters' displacement keeps the direction of 32-bit Muon's (measured
    cosine >= 0.99995 8-bit, 0.9912 4-bit, 0.9997 fp8) and its size within ``relative`` (measured at most 0.0103,
    0.132, 0.0237); a matrix under min_8bit_size keeps fp32 state and equals 32-bit bit for bit."""
    shapes = [(4100, 3), (96, 64), (64, 32)]
    params = make_params(shapes)
    start = [p.detach().clone() for p in params]
    low = clones(params)
    run(Muon(params, lr=0.02), params, 8)
    opt = Muon(low, lr=0.02, state_format=fmt)
    run(opt, low, 8)
    for p, q, p0 in zip(params, low, start):
        if p.numel() < 4096:
            assert torch.equal(p, q) and opt.state[q]["state1"].dtype == torch.float32
            continue
        assert opt.state[q]["state1"].element_size() == 1  # codes: 4-bit packs two per byte
        moved, low_moved = (p - p0).flatten(), (q - p0).flatten()
        assert torch.nn.functional.cosine_similarity(moved, low_moved, dim=0) >= cosine
        assert (moved - low_moved).norm() <= relative * moved.norm()


# --------------------------------------------------------------------------------------------------------------
# The AdamW rule of a hybrid optimizer
HYBRID_SHAPES = [(64, 48), (300,), (48,), (5000,), (3, 4, 5)]


def hybrid(params, **kwargs):
    """A Muon group (the matrix) and an AdamW group (the rest), MuonWithAuxAdam-style."""
    return [{"params": params[:1], "use_muon": True}, {"params": params[1:], "use_muon": False, **kwargs}]


@pytest.mark.parametrize("fmt", ["fp32", "blockwise8", "blockwise4"])
def test_adamw_side_equals_hf_optim_adamw_bit_for_bit(fmt):
    params = make_params(HYBRID_SHAPES)
    twins = clones(params)
    opt = Muon(hybrid(params, lr=3e-3, weight_decay=0.01), lr=0.02, adamw_betas=(0.9, 0.95), adamw_eps=1e-7,
               state_format=fmt)
    adamw = hf_optim.AdamW(twins[1:], lr=3e-3, betas=(0.9, 0.95), eps=1e-7, weight_decay=0.01, state_format=fmt)
    for step in range(4):
        set_grads(params, step)
        for p, q in zip(params[1:], twins[1:]):
            q.grad = p.grad.clone()
        opt.step()
        adamw.step()
    for p, q in zip(params[1:], twins[1:]):
        assert torch.equal(p, q), tuple(p.shape)
        assert sorted(opt.state[p]) == sorted(adamw.state[q])


def test_adamw_side_follows_torch_adamw():
    params = make_params(HYBRID_SHAPES)
    twins = clones(params)
    opt = Muon(hybrid(params, lr=3e-3, weight_decay=0.01))
    adamw = torch.optim.AdamW(twins[1:], lr=3e-3, weight_decay=0.01)
    for step in range(4):
        set_grads(params, step)
        for p, q in zip(params[1:], twins[1:]):
            q.grad = p.grad.clone()
        opt.step()
        adamw.step()
    for p, q in zip(params[1:], twins[1:]):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_adamw_lr_and_weight_decay_follow_the_group_schedule():
    """A fixed ``adamw_lr`` is scaled as the LR scheduler scales the group's lr (``lr / initial_lr``)."""
    params = make_params([(40, 30), (70,)])
    twin = clones(params)[1:]
    opt = Muon(params, lr=0.02, adamw_lr=1e-3, adamw_weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    adamw = hf_optim.AdamW(twin, lr=1e-3, weight_decay=0.0)
    adamw_schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5 ** step)
    for step in range(3):
        set_grads(params, step)
        twin[0].grad = params[1].grad.clone()
        opt.step()
        adamw.step()
        schedule.step()
        adamw_schedule.step()
    assert torch.equal(params[1], twin[0])


def test_use_muon_none_routes_by_shape_and_by_marks():
    params = make_params([(40, 30), (30,), (2, 3, 4), (50, 20), (20, 10)])
    setattr(params[3], MUON_ROUTE_ATTR, "adamw")
    setattr(params[4], MUON_ROUTE_ATTR, "lora")
    opt = Muon(params)  # muon_lora defaults to False: LoRA adapters take AdamW (docs/muon_defaults.md)
    run(opt, params, 1)
    slots = [sorted(k for k in opt.state[p] if k.startswith("state")) for p in params]
    assert slots == [["state1"], ["state1", "state2"], ["state1", "state2"], ["state1", "state2"],
                     ["state1", "state2"]]
    assert [Muon.takes_muon(p, {**opt.param_groups[0], "muon_lora": True}) for p in params] == [
        True, False, False, False, True]


# --------------------------------------------------------------------------------------------------------------
# State dicts
@pytest.mark.parametrize("cls,fmt", [(Muon, "fp32"), (Muon8bit, "blockwise8"), (hf_optim.PagedMuon4bit, "stochastic4")])
def test_state_dict_round_trip_resumes_bit_for_bit(cls, fmt):
    params = make_params(HYBRID_SHAPES)
    opt = build(cls, hybrid(params, lr=3e-3), lr=0.02)
    run(opt, params, 2)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed_params = clones(params)
    resumed = build(cls, hybrid(resumed_params, lr=3e-3), lr=0.02)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    run(opt, params, 2, start=2)
    run(resumed, resumed_params, 2, start=2)
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q), tuple(p.shape)
        for key, value in opt.state[p].items():
            other = resumed.state[q][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
    assert [g["state_format"] for g in resumed.param_groups] == [fmt, fmt]


def test_loading_state_of_another_rule_or_algorithm_raises():
    """A state dict whose slots belong to the other rule loads (each set is checked as itself), and the first step
    refuses it before changing anything; another algorithm's state dict is refused at loading."""
    params = make_params([(40, 30), (40, 30)])
    opt = Muon([{"params": params[:1], "use_muon": True}, {"params": params[1:], "use_muon": False}])
    run(opt, params, 1)
    saved = opt.state_dict()
    saved["state"][0], saved["state"][1] = saved["state"][1], saved["state"][0]
    swapped = clones(params)
    flipped = Muon([{"params": swapped[:1], "use_muon": True}, {"params": swapped[1:], "use_muon": False}])
    flipped.load_state_dict(saved)
    set_grads(swapped, 1)
    before = [p.detach().clone() for p in swapped]
    with pytest.raises(ValueError, match="now takes the Muon rule but its state holds"):
        flipped.step()
    assert all(torch.equal(p, b) for p, b in zip(swapped, before))
    assert [flipped.state[p]["step"] for p in swapped] == [1, 1]
    adamw = hf_optim.AdamW(clones(params))
    run(adamw, adamw.param_groups[0]["params"], 1)
    with pytest.raises(StateDictError, match="'adamw' optimizer"):
        Muon(clones(params), use_muon=False).load_state_dict(adamw.state_dict())


# --------------------------------------------------------------------------------------------------------------
# Refusals
@pytest.mark.parametrize("kwargs,message", [
    ({"adjust_lr_fn": "match_rms_adam"}, "did you mean 'match_rms_adamw'"),
    ({"ns_steps": 0}, "ns_steps must be an integer from 1 to 99"),
    ({"momentum": 1.5}, "momentum"),
    ({"ns_coefficients": (1.0, 2.0)}, "ns_coefficients must be a tuple of 3"),
    ({"use_muon": "yes"}, "use_muon must be True, False or None"),
    ({"adamw_betas": (0.9,)}, "betas must be a tuple of 2"),
    ({"adamw_eps": 0.0}, "adamw_eps"),
    ({"lr": -1.0}, "lr"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Muon(make_params([(4, 4)]), **kwargs)


def test_a_non_matrix_in_a_muon_group_names_the_fix():
    with pytest.raises(ValueError, match=r"shape \(30,\).*use_muon=False.*leave use_muon unset"):
        Muon(make_params([(30, 20), (30,)]), use_muon=True)
    with pytest.raises(ValueError, match="use_muon=False"):
        Muon(make_params([(30, 20)]), use_muon=True).add_param_group({"params": make_params([(2, 3, 4)])})


# --------------------------------------------------------------------------------------------------------------
# Memory: the estimator and state_memory
@pytest.mark.parametrize("name,per_param", [
    ("muon", 4.0),
    ("muon_8bit", 1.0),  # + one fp32 absmax per 256 and the map
    ("muon_4bit", 0.5 + 4 / 64),  # stochastic4: half a byte and one fp32 scale per 64 elements
])
def test_estimator_prices_one_momentum_per_matrix_and_two_moments_elsewhere(name, per_param):
    shapes = [(256, 512), (512, 256), (512,)]
    params = make_params(shapes)
    cls, kwargs = optimizer_cls_and_kwargs(_Args(), name=name)
    opt = cls(params, **kwargs)
    run(opt, params, 1)
    held = hf_optim.state_memory(opt).total_bytes
    tensors = [TensorCount(p.numel(), p.element_size(), tuple(p.shape), False) for p in params]
    assert state_bytes(name, tensors) == held
    matrix_bytes = sum(v.nbytes for p in params[:2] for v in opt.state[p].values() if isinstance(v, torch.Tensor))
    assert math.isclose(matrix_bytes / (2 * 256 * 512), per_param, rel_tol=0.07)
    assert sum(v.nbytes for v in opt.state[params[2]].values() if isinstance(v, torch.Tensor)) == 2 * 4 * 512


@pytest.mark.parametrize("lora,optim_args", [(False, None), (True, None), (True, "muon_lora=true")])
@pytest.mark.parametrize("name", ["muon", "muon_8bit", "muon_4bit"])
def test_estimator_prices_each_tensor_with_the_rule_the_trainer_routes_it_to(name, lora, optim_args):
    """The tied embedding (2-D, AdamW's two moments) and the LoRA adapters (AdamW unless muon_lora) priced as the
    Trainer-built optimizer holds them, on a Llama-shaped model."""
    from hf_optim.recipes.estimate import trainable_tensors
    from hf_optim.tiny import tiny_llama

    model = tiny_llama(layers=1)
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    args = _Args()
    args.optim_args = optim_args
    cls, kwargs = optimizer_cls_and_kwargs(args, model, name=name)  # routes the model; the embedding keeps fp32
    params = [p for p in model.parameters() if p.requires_grad]
    opt = cls(params, **kwargs)
    run(opt, params, 1)
    assert state_bytes(name, trainable_tensors(model), optim_args) == hf_optim.state_memory(opt).total_bytes


class _Args:
    learning_rate, adam_beta1, adam_beta2, adam_epsilon, optim_args = 1e-3, 0.9, 0.95, 1e-8, None


# --------------------------------------------------------------------------------------------------------------
# The Trainer: routing a model, names, a few steps
def test_route_model_sends_hidden_matrices_to_muon_and_the_rest_to_adamw():
    from hf_optim.tiny import tiny_llama

    model = tiny_llama(layers=2)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied: both to AdamW
    routes = route_model(model)
    got = {name: getattr(p, MUON_ROUTE_ATTR) for name, p in model.named_parameters()}
    for name, route in got.items():
        hidden = ".layers." in name and name.endswith(("proj.weight",))
        assert route == ("muon" if hidden else "adamw"), name
    assert got["model.embed_tokens.weight"] == got["lm_head.weight"] == "adamw"
    params = dict(model.named_parameters())
    muon = [p for name, p in params.items() if got[name] == "muon"]
    assert routes.muon_tensors == len(muon) == 2 * 7 and routes.muon_elements == sum(p.numel() for p in muon)
    assert routes.adamw_tensors == len(params) - len(muon)


def test_route_model_marks_lora_adapters():
    peft = pytest.importorskip("peft")
    from hf_optim.tiny import tiny_llama

    model = peft.get_peft_model(tiny_llama(layers=1), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    routes = route_model(model, muon_lora=False)
    marked = {name: getattr(p, MUON_ROUTE_ATTR) for name, p in model.named_parameters() if p.requires_grad}
    assert marked and all(route == "lora" for route in marked.values())
    assert routes.muon_tensors == 0 and routes.adamw_tensors == len(marked)


def test_routes_survive_parameters_swapped_at_their_place():
    """accelerate's FSDP2 preparation replaces each parameter in param_groups by a new (DTensor) one: the marks
    stay on the old objects, so the optimizer keeps them by position (the tied embedding stays AdamW's)."""
    import copy

    from hf_optim.tiny import tiny_llama

    model = tiny_llama(layers=1)
    route_model(model)
    names = [name for name, _ in model.named_parameters()]
    opt = Muon(model.parameters(), lr=0.01)
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters

    swapped = {p.data_ptr: torch.nn.Parameter(p.detach().clone()) for p in model.parameters()}
    fsdp2_switch_optimizer_parameters(opt, swapped)  # what accelerate's FSDP2 preparation does
    assert not any(hasattr(p, MUON_ROUTE_ATTR) for p in opt.param_groups[0]["params"])
    opt = copy.deepcopy(opt)  # the record travels with the optimizer (pickling, deepcopy)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    opt.step()
    slots = {name: sorted(k for k in opt.state[p] if k.startswith("state"))
             for name, p in zip(names, opt.param_groups[0]["params"])}
    assert slots["model.embed_tokens.weight"] == ["state1", "state2"]  # 2-D, but AdamW's: its mark was recorded
    assert slots["model.layers.0.self_attn.q_proj.weight"] == ["state1"]


@pytest.mark.parametrize("optim_args,warned", [(None, True), ("muon_lora=true", False)])
def test_a_lora_run_under_a_muon_name_says_that_no_tensor_takes_muon(optim_args, warned, tmp_path, hf_optim_records):
    peft = pytest.importorskip("peft")
    from transformers import TrainingArguments

    from hf_optim.integrations.transformers import optimizer_cls_and_kwargs
    from hf_optim.tiny import tiny_llama

    model = peft.get_peft_model(tiny_llama(layers=1), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(output_dir=str(tmp_path), optim="muon_8bit", optim_args=optim_args, report_to="none")
    optimizer_cls_and_kwargs(args, model)
    warnings_seen = [r.getMessage() for r in hf_optim_records if r.levelname == "WARNING"]
    assert (len(warnings_seen) == 1 and "muon_lora=true" in warnings_seen[0]) == warned, warnings_seen
    assert any("Muon: 0 tensors" in r.getMessage() for r in hf_optim_records) == warned


@pytest.mark.parametrize("name,cls", [
    ("muon", hf_optim.Muon32bit), ("muon_32bit", hf_optim.Muon32bit), ("muon_8bit", Muon8bit),
    ("muon_4bit", hf_optim.Muon4bit), ("paged_muon_8bit", hf_optim.PagedMuon8bit),
])
def test_trainer_names_build_muon_with_one_learning_rate_for_both_sides(name, cls):
    args = _Args()
    args.optim_args = "adamw_lr=0.002,adamw_betas=0.9;0.99,adjust_lr_fn=original,muon_lora=false"
    built, kwargs = optimizer_cls_and_kwargs(args, name=name)
    assert built is cls
    assert kwargs["adamw_betas"] == (0.9, 0.99) and kwargs["adamw_lr"] == 0.002 and kwargs["muon_lora"] is False
    assert kwargs["adjust_lr_fn"] == "original"
    _, plain = optimizer_cls_and_kwargs(_Args(), name=name)
    assert plain["adjust_lr_fn"] == "match_rms_adamw" and plain.get("adamw_lr") is None


def test_a_few_trainer_steps_route_and_train(tmp_path, hf_optim_records):
    from trainer_helpers import common_args, inner_optimizer, losses, token_dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from hf_optim.tiny import tiny_llama, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_llama(layers=1)
    args = TrainingArguments(**common_args(tmp_path, "muon_8bit", max_steps=4, per_device_train_batch_size=4,
                                           weight_decay=0.01))
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(tokenizer, 16),
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    assert sum("routes Muon:" in record.getMessage() for record in hf_optim_records) == 1
    optimizer = inner_optimizer(trainer)
    assert type(optimizer) is Muon8bit
    for name, p in model.named_parameters():
        slots = sorted(k for k in optimizer.state[p] if k.startswith("state"))
        assert slots == (["state1"] if getattr(p, MUON_ROUTE_ATTR) == "muon" else ["state1", "state2"]), name
    assert optimizer.state[model.model.layers[0].mlp.up_proj.weight]["state1"].dtype == torch.uint8
    assert optimizer.state[model.model.embed_tokens.weight]["state1"].dtype == torch.float32  # 32-bit embeddings
    loss = losses(trainer)
    assert len(loss) == 4 and all(math.isfinite(v) for v in loss) and loss[-1] < loss[0]


# --------------------------------------------------------------------------------------------------------------
# Distributed: DDP (whole gradients) and FSDP2 (sharded matrices, gathered for Newton-Schulz)
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_gloo_processes_step_as_one_process_given_their_gradients(mode, tmp_path):
    """DDP: each rank steps the whole all-reduced gradient. FSDP2: each rank steps its rows of every matrix and
    all-gathers the update for Newton-Schulz; its 8-bit state is quantized in blocks of each rank's rows, and the
    model's shards hold whole blocks. Either way both ranks hold the same bits, and they are BIT FOR BIT those of one
    process that computes each rank's half-batch gradient itself (1 thread, as each rank) and combines the two with
    the collective's own arithmetic (``muon_ddp_worker.train_as_ranks``: ``g0 * 0.5 + g1 * 0.5`` under DDP,
    ``(g0 + g1) / 2`` under FSDP2; both exact for two ranks), then steps Muon on plain tensors. That holds on any
    CPU and kernel set, since both sides run the same kernels on the same shapes.

    Why no bound against one process on the whole batch: its gradient differs from the combined half-batch ones
    in the last fp32 bits (up to 4e-7 of each tensor's largest element here), and Newton-Schulz turns such
    differences into large ones. A bf16 rounding that flips changes one element of the normalized input by one
    bf16 ulp, and the slope of 5 quintic iterations at a small singular value is a**5 = 3.4445**5 = 485, so the
    output can move by 485 such ulps: 0.24 for an element near 0.1, the size of the output's own elements. No
    bound derived from what the CPU's fp32 or bf16 GEMM guarantees is below the update itself. Each Muon
    matrix's first update has rank <= 8 (a batch of 8), rounding it to bf16 adds 24 singular values of 3e-5..7e-4
    (relative) that are rounding noise, and Newton-Schulz lifts them to 0.02..0.46. Measured on these matrices, a
    one-ulp change of ONE bf16 input element moves the output (largest element 0.14..0.36) by 0.005..0.015
    (median) and up to 0.24, and later steps feed that back into the gradients. Which roundings flip depends on
    the GEMM kernels: after 4 steps the (96, 32) matrix of ``muon_32bit`` differed from the whole-batch run by
    2.1e-3 on AVX2 and 6.8e-5 under ``ATEN_CPU_CAPABILITY=default`` (the largest difference was 2.9e-5 where the
    earlier bound of one bf16 flip per step was set), and ``muon_8bit``'s (64, 96) one by 6.8e-4 under
    ``default``, past that bound too, while the exact comparison here holds under each."""
    import muon_ddp_worker as case

    out = tmp_path / f"{mode}.pt"
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "OMP_NUM_THREADS": "1", "HF_OPTIM_COMPILE": "0"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(TESTS / "muon_ddp_worker.py"), str(out), mode]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=TESTS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    ranks = [torch.load(f"{out}.{rank}", weights_only=True) for rank in (0, 1)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in case.NAMES:
            expected = case.train_as_ranks(name, mode)
            for got, other, want in zip(ranks[0][name], ranks[1][name], expected, strict=True):
                assert torch.equal(got, other), (name, mode, tuple(got.shape))
                assert torch.equal(got, want), (name, mode, tuple(got.shape), float((got - want).abs().max()))
    finally:
        torch.set_num_threads(threads)


def test_a_sharded_matrix_in_one_process_steps_as_the_whole_matrix(tmp_path):
    """A DTensor parameter on a 1-rank mesh: the gather and the slicing of the update are the identity, so Muon's
    sharded path gives the plain tensor's bits (the 2-process test above checks a real split)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        values, bias_values = torch.randn(8, 6), torch.randn(8)
        grads = [(torch.randn(8, 6), torch.randn(8)) for _ in range(3)]
        weight = torch.nn.Parameter(distribute_tensor(values.clone(), mesh, [Shard(0)]))
        bias = torch.nn.Parameter(distribute_tensor(bias_values.clone(), mesh, [Shard(0)]))
        plain = [torch.nn.Parameter(values.clone()), torch.nn.Parameter(bias_values.clone())]
        sharded_opt, plain_opt = Muon([weight, bias], lr=0.02), Muon(plain, lr=0.02)
        for g, b in grads:
            weight.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            bias.grad = distribute_tensor(b.clone(), mesh, [Shard(0)])
            plain[0].grad, plain[1].grad = g.clone(), b.clone()
            sharded_opt.step()
            plain_opt.step()
        assert torch.equal(weight.detach().full_tensor(), plain[0].detach())
        assert torch.equal(bias.detach().full_tensor(), plain[1].detach())
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------------
# On a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp32", "blockwise8", "fp8"])
def test_on_cuda_follows_torch_optim_muon(fmt):
    """On CUDA (bf16 Newton-Schulz on the GPU's tensor cores, the momentum on whatever path the format takes there):
    32-bit within the CPU test's bounds of ``torch.optim.Muon`` on the same GPU, 8-bit and fp8 momentum moving the
    parameters as 32-bit does (the CPU test's cosine and size bounds)."""
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(MATRICES, seed=3)]
    start = [p.detach().clone() for p in params]
    reference = clones(params)
    ours = Muon(params, lr=0.02, state_format=fmt)
    theirs = torch.optim.Muon(reference, lr=0.02)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(10_000 + step)
        for p, q in zip(params, reference):
            p.grad = torch.randn(p.shape, generator=gen).cuda()
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, q, p0 in zip(params, reference, start):
        step_lr = adjusted_lr(0.02, None, tuple(p.shape))
        if fmt == "fp32" or p.numel() < 4096:
            assert (p - q).abs().max() <= STEPS * step_lr * 2.0**-7, tuple(p.shape)
            continue
        moved, low_moved = (q - p0).flatten(), (p - p0).flatten()
        assert torch.nn.functional.cosine_similarity(moved, low_moved, dim=0) >= 0.999
        assert (moved - low_moved).norm() <= 0.06 * moved.norm()
