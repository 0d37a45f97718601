"""The "one-line switch" from bitsandbytes: every class takes its ``bitsandbytes.optim`` namesake's constructor
arguments (names, order, defaults), compared with the installed bitsandbytes (a test dependency); the differences
are listed here with the reason, and each class's docstring says them."""

import inspect
import warnings

import bitsandbytes.optim as bnb_optim
import pytest
import torch
from helpers import ALL_CLASSES

import hf_optim

NO_NAMESAKE = {
    # hf_optim's own precisions and algorithms, which bitsandbytes does not have
    "AdamW4bit", "PagedAdamW4bit", "AdEMAMix4bit", "PagedAdEMAMix4bit", "Lion4bit", "PagedLion4bit",
    "AdamW4bitBlockwise", "PagedAdamW4bitBlockwise", "AdEMAMix4bitBlockwise", "PagedAdEMAMix4bitBlockwise",
    "Lion4bitBlockwise", "PagedLion4bitBlockwise",
    "AdamW4bitRank1", "PagedAdamW4bitRank1", "AdEMAMix4bitRank1", "PagedAdEMAMix4bitRank1",
    "AdamWFp8", "PagedAdamWFp8", "AdEMAMixFp8", "PagedAdEMAMixFp8", "LionFp8", "PagedLionFp8",
    "PagedLAMB", "PagedLAMB8bit", "PagedLAMB32bit", "Adafactor",
    "Muon", "Muon4bit", "Muon8bit", "Muon32bit", "MuonFp8", "PagedMuon", "PagedMuon4bit", "PagedMuon8bit",
    "PagedMuon32bit", "PagedMuonFp8", "Muon4bitBlockwise", "PagedMuon4bitBlockwise",
}
LAMB_FAMILY = {"LAMB", "LAMB8bit", "LAMB32bit"}
DIFFERENT_DEFAULTS = {
    # argument: (hf_optim's default, bitsandbytes', what the docstring says). hf_optim's LAMB is apex's algorithm,
    # with apex's defaults; bitsandbytes' is Adam with an update-norm clip (see hf_optim/optim/lamb/__init__.py).
    "eps": (1e-6, 1e-8, "bitsandbytes' is 1e-8"),
    "weight_decay": (0.01, 0, "bitsandbytes' is 0"),
    "max_unorm": (0.0, 1.0, "bitsandbytes' default is 1.0"),
}
NAMESAKES = [cls for cls in ALL_CLASSES if cls.__name__ not in NO_NAMESAKE]


def parameters(cls) -> list[inspect.Parameter]:
    return list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self


def test_the_classes_without_a_namesake_really_have_none():
    """If bitsandbytes adds one of these, its signature must be compared too."""
    assert {cls.__name__ for cls in ALL_CLASSES} >= NO_NAMESAKE
    assert not [name for name in NO_NAMESAKE if hasattr(bnb_optim, name)]


@pytest.mark.parametrize("cls", NAMESAKES, ids=lambda cls: cls.__name__)
def test_every_class_takes_its_namesakes_arguments_in_order_with_its_defaults(cls):
    """bitsandbytes' parameters are the first ones of hf_optim's, with the same names, kinds and defaults; hf_optim's
    own arguments (bf16_stochastic_round, LAMB's use_nvlamb, ...) come after them."""
    theirs, ours = parameters(getattr(bnb_optim, cls.__name__)), parameters(cls)
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs], (ours, theirs)
    for mine, other in zip(ours, theirs):
        assert mine.kind == other.kind, mine.name
        if cls.__name__ in LAMB_FAMILY and mine.name in DIFFERENT_DEFAULTS:
            ours_default, their_default, _ = DIFFERENT_DEFAULTS[mine.name]
            assert (mine.default, other.default) == (ours_default, their_default), mine.name
            continue
        assert mine.default == other.default, (mine.name, mine.default, other.default)


@pytest.mark.parametrize("name", sorted(LAMB_FAMILY))
def test_each_different_default_is_in_the_docstring(name):
    doc = " ".join(getattr(hf_optim, name).__doc__.split())
    for argument, (_, _, says) in DIFFERENT_DEFAULTS.items():
        assert says in doc, (argument, says)


@pytest.mark.parametrize("cls", NAMESAKES, ids=lambda cls: cls.__name__)
def test_bitsandbytes_defaults_passed_positionally_build_the_same_optimizer(cls):
    """``cls(params, *bitsandbytes' defaults)`` in bitsandbytes' order: every argument lands where bitsandbytes
    puts it (for LAMB, bitsandbytes' eps, weight_decay and max_unorm values arrive as such)."""
    names = [p.name for p in parameters(getattr(bnb_optim, cls.__name__))[1:]]  # after params
    defaults = [p.default for p in parameters(getattr(bnb_optim, cls.__name__))[1:]]
    params = [torch.nn.Parameter(torch.randn(3, 3))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged twins on CPU; LAMB with bitsandbytes' weight_decay=0
        positional = cls(params, *defaults)
        by_name = cls(params, **dict(zip(names, defaults)))
    assert positional.defaults == by_name.defaults
    if cls.__name__ in LAMB_FAMILY:
        assert (positional.defaults["eps"], positional.defaults["weight_decay"]) == (1e-8, 0)
        assert positional.defaults["max_unorm"] == 1.0


@pytest.mark.parametrize("name", ["AdamW8bit", "PagedAdamW8bit"])
def test_adamw8bit_takes_bitsandbytes_optim_bits_and_keeps_8bit_state(name):
    """bitsandbytes' AdamW8bit takes optim_bits=32 (its default, ignored) and only that; hf_optim takes it too, or
    8, and refuses anything else; the state is 8-bit either way, as in bitsandbytes."""
    cls = getattr(hf_optim, name)
    for bits in (32, 8):
        p = torch.nn.Parameter(torch.randn(64, 80))
        p.grad = torch.randn(64, 80)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # paged on CPU
            opt = cls([p], optim_bits=bits)
            opt.step()
        assert opt.state[p]["state1"].dtype == torch.uint8
    reference = torch.nn.Parameter(torch.randn(64, 80))
    reference.grad = torch.randn(64, 80)
    theirs = getattr(bnb_optim, name)([reference], optim_bits=32)
    theirs.step()
    assert theirs.state[reference]["state1"].dtype == torch.uint8
    with pytest.raises(ValueError, match=f"Invalid optim_bits: 4; {name} keeps 8-bit state"):
        cls([p], optim_bits=4)


def test_an_unpaged_twin_takes_is_paged_as_bitsandbytes_does():
    p = torch.nn.Parameter(torch.randn(8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paging on CPU keeps ordinary memory, with a notice
        assert hf_optim.AdamW8bit([p], is_paged=True).is_paged
    assert not hf_optim.Lion8bit([p]).is_paged
    with pytest.raises(ValueError, match="PagedAdamW8bit fixes is_paged=True; got is_paged=False"):
        hf_optim.PagedAdamW8bit([p], is_paged=False)
