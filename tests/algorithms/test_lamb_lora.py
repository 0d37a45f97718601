"""LAMB with LoRA (docs/guide/optimizers.md, "LAMB and LoRA"): peft starts LoRA's B matrices at zero, and LAMB's
trust ratio ``||p|| / ||u||`` then keeps them near zero, so LAMB warns at the first step; with weights that are not
zero (a full fine-tune) it trains them at its relative step."""

import warnings

import peft
import pytest
import torch

import hf_optim
from hf_optim.optim.lamb import ZERO_START_WARNING

STEPS = 20
LR = 5e-3


def lora_model(seed=0):
    torch.manual_seed(seed)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    config = peft.LoraConfig(r=8, lora_alpha=8, target_modules=["0", "2"], lora_dropout=0.0)
    return peft.get_peft_model(base, config)


def lora_tensors(model, which):
    return [p for name, p in model.named_parameters() if f"lora_{which}" in name]


def train(model, opt, steps=STEPS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(16, 8, generator=gen)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        opt.zero_grad()
        (model(x) - target).square().mean().backward()
        opt.step()


def warnings_of(factory, steps=2):
    model = lora_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = factory([p for p in model.parameters() if p.requires_grad])
        train(model, opt, steps)
    return [str(w.message) for w in caught if "start at zero" in str(w.message)]


@pytest.mark.parametrize("cls", [hf_optim.LAMB, hf_optim.LAMB8bit], ids=["LAMB", "LAMB8bit"])
def test_lamb_warns_once_when_its_trust_ratio_meets_loras_zero_b_matrices(cls):
    found = warnings_of(lambda params: cls(params, lr=LR, min_8bit_size=0))
    assert found == [ZERO_START_WARNING.format(name=cls.__name__, count=2)]  # the two B matrices, once
    assert "\n" not in found[0]


@pytest.mark.parametrize(
    "factory",
    [
        lambda params: hf_optim.AdamW8bit(params, lr=LR),
        lambda params: hf_optim.LAMB(params, lr=LR, weight_decay=0.0),  # apex: no trust ratio without decay
    ],
    ids=["AdamW8bit", "LAMB-no-trust-ratio"],
)
def test_no_warning_where_no_trust_ratio_meets_a_zero_tensor(factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LAMB's own weight_decay=0 notice
        assert warnings_of(factory) == []


def test_the_trust_ratio_keeps_b_near_zero_while_adamw_trains_it():
    """The finding behind the warning, on the formula: after B's first step (ratio 1, ||B|| = lr * ||u||), LAMB
    moves B by lr * ||B|| per step, so ||B|| stays within a few percent of its first-step value, while AdamW moves
    each element by about lr per step."""
    norms = {}
    for name, factory in [("lamb", lambda p: hf_optim.LAMB(p, lr=LR)), ("adamw", lambda p: hf_optim.AdamW(p, lr=LR))]:
        model = lora_model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = factory([p for p in model.parameters() if p.requires_grad])
            train(model, opt, 1)
            first = [p.detach().norm().item() for p in lora_tensors(model, "B")]
            train(model, opt, STEPS - 1, seed=1)
        norms[name] = (first, [p.detach().norm().item() for p in lora_tensors(model, "B")])
    for first, last in zip(*norms["lamb"]):
        assert 0 < first <= last <= first * (1 + LR) ** (STEPS - 1) * (1 + 1e-6)  # at most (1 + lr) per step
    for adamw_last, lamb_last in zip(norms["adamw"][1], norms["lamb"][1]):
        assert adamw_last > 5 * lamb_last  # AdamW's B has grown many times further


def final_loss(factory, steps=STEPS):
    """The loss on one fixed batch after ``steps`` steps on it."""
    model = lora_model()
    gen = torch.Generator().manual_seed(0)
    x, target = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = factory([p for p in model.parameters() if p.requires_grad])
        for _ in range(steps):
            opt.zero_grad()
            (model(x) - target).square().mean().backward()
            opt.step()
    with torch.no_grad():
        return (model(x) - target).square().mean().item()


def test_a_tenfold_lr_lets_lamb_train_lora_as_adamw_does():
    """The guide's rule for LAMB under LoRA (docs/guide/optimizers.md#lamb-and-lora: about 10x AdamW's lr): at
    AdamW's lr LAMB leaves the loss near where it started; at 10x it gets about as far as AdamW."""
    start = final_loss(lambda p: hf_optim.AdamW(p, lr=LR), steps=0)
    adamw = final_loss(lambda p: hf_optim.AdamW(p, lr=LR))
    lamb = final_loss(lambda p: hf_optim.LAMB(p, lr=LR))
    lamb_10x = final_loss(lambda p: hf_optim.LAMB(p, lr=10 * LR))
    assert start - lamb < 0.2 * (start - adamw)  # at AdamW's lr LAMB gets under a fifth of AdamW's way
    assert start - lamb_10x > 0.7 * (start - adamw)
