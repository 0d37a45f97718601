"""A small full fine-tune: 8-bit optimizers reach the loss of their 32-bit twins (within 1%)."""

import functools

import pytest

import hf_optim
from hf_optim.tiny import train_tiny

STEPS = 120


@functools.cache
def reference_losses(thirty_two, lr: float) -> tuple[float, ...]:
    """The 32-bit twin's run, once per module: the 8-bit and the 4-bit test compare against the same run (train_tiny
    seeds its model and data, so a second run would repeat it)."""
    return tuple(train_tiny(lambda params: thirty_two(params, lr=lr), steps=STEPS, seq_len=32))


def final_loss(losses):
    """Mean of the last 10 steps: less noisy than the last step alone."""
    return sum(losses[-10:]) / 10


@pytest.mark.slow
@pytest.mark.parametrize(
    "eight,thirty_two,kwargs",
    [
        (hf_optim.AdamW8bit, hf_optim.AdamW32bit, dict(lr=3e-3)),
        (hf_optim.AdEMAMix8bit, hf_optim.AdEMAMix32bit, dict(lr=3e-3)),
    ],
    ids=["AdamW", "AdEMAMix"],
)
def test_8bit_final_loss_within_one_percent_of_32bit(eight, thirty_two, kwargs):
    losses32 = reference_losses(thirty_two, **kwargs)
    losses8 = train_tiny(lambda params: eight(params, **kwargs), steps=STEPS, seq_len=32)
    assert final_loss(losses32) < 0.6 * losses32[0], "the run must actually learn for the comparison to mean much"
    assert abs(final_loss(losses8) - final_loss(losses32)) <= 0.01 * final_loss(losses32)


@pytest.mark.slow
@pytest.mark.parametrize(
    "four,thirty_two,kwargs",
    [
        (hf_optim.AdamW4bit, hf_optim.AdamW32bit, dict(lr=3e-3)),
        (hf_optim.AdEMAMix4bit, hf_optim.AdEMAMix32bit, dict(lr=3e-3)),
    ],
    ids=["AdamW", "AdEMAMix"],
)
def test_4bit_final_loss_within_one_and_a_half_percent_of_32bit(four, thirty_two, kwargs):
    """The default 4-bit state (``stochastic4``) within 1.5% of 32-bit: issue 45's bar (measured +0.55% and +0.79%
    here; ``blockwise4``, the default before, +0.9% and +0.4% on this run, but 5-8% off on quality4.py's MLP). Lion4bit
    is not held to it: its slow momentum (beta2 = 0.99) accumulates the 4-bit storage error, +2.4% here and +2.7-3.2%
    on the MLP (blockwise4: +3.9%, +4.2-5.5%; docs/performance.md#quality-of-quantized-state)."""
    losses32 = reference_losses(thirty_two, **kwargs)
    losses4 = train_tiny(lambda params: four(params, **kwargs), steps=STEPS, seq_len=32)
    assert final_loss(losses32) < 0.6 * losses32[0], "the run must actually learn for the comparison to mean much"
    assert abs(final_loss(losses4) - final_loss(losses32)) <= 0.015 * final_loss(losses32)
