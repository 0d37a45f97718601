"""``state_format=``: every class takes the format registry's names, ``optim_bits`` stays bitsandbytes' alias, and
class names, ``optim=`` names and labels derive from what each format declares."""

import inspect
from pathlib import Path

import pytest
import torch
from format_helpers import build
from helpers import ALL_CLASSES, make_params, run_steps

import hf_optim
from hf_optim.formats import FORMATS, StateFormat, format_for_bits, loaded_format, register_format
from hf_optim.formats.blockwise8 import Blockwise8
from hf_optim.integrations.names import OPTIMIZER_NAMES
from hf_optim.integrations.optim_args import OptimArgsError, typed_optim_args
from hf_optim.optim import options, registry
from hf_optim.optim.base import PARAM_OVERRIDES_ATTR
from hf_optim.optim.trainer_mapping import parse_name, trainer_names

BASES = [family.base for family in registry.families()]
SHAPES = [(64, 80), (4100,), (7,)]  # quantized, quantized (odd block count), under min_8bit_size (fp32)


def formats_of(opt) -> list[str]:
    """The format each parameter's state is in: its last slot's (``state2``, or Adafactor's ``exp_avg``; a format
    may store the first moment as another does: ``StateFormat.stored_as``)."""
    return [loaded_format(opt.state[p], opt.state_specs[-1]).name for group in opt.param_groups
            for p in group["params"]]


@pytest.mark.parametrize("cls", BASES, ids=lambda cls: cls.__name__)
def test_every_base_class_runs_every_format_it_offers_by_name(cls):
    """Each name gives state in that format (fp32 under ``min_8bit_size``), the same state as its optim_bits alias."""
    for fmt in cls._supported_formats():
        params = make_params(SHAPES)
        opt = build(cls, params, state_format=fmt.name)
        run_steps(opt, params, 2)
        last = fmt.stored_as(cls.state_specs[-1]).name
        assert formats_of(opt) == [last, last, "fp32"]
        assert opt.param_groups[0]["state_format"] == fmt.name
        assert opt.param_groups[0]["optim_bits"] == fmt.group_bits  # fp8: 8, recorded for bitsandbytes' readers
        if fmt.optim_bits is None:  # no bitsandbytes alias (fp8, rank1_4bit): chosen by name only
            continue
        alias_params = make_params(SHAPES)
        alias = build(cls, alias_params, optim_bits=fmt.optim_bits)
        run_steps(alias, alias_params, 2)
        for p, q in zip(params, alias_params):
            assert torch.equal(p, q)
            for key, value in opt.state[p].items():
                assert torch.equal(value, alias.state[q][key]) if isinstance(value, torch.Tensor) else \
                    value == alias.state[q][key]


def test_optim_bits_is_the_alias_of_the_bitsandbytes_formats():
    assert {bits: format_for_bits(bits).name for bits in (32, 8, 4)} == {32: "fp32", 8: "blockwise8", 4: "stochastic4"}
    p = torch.nn.Parameter(torch.randn(8))
    assert hf_optim.AdamW([p]).param_groups[0]["state_format"] == "fp32"  # bitsandbytes' default optim_bits=32
    assert hf_optim.AdamW([p], optim_bits=4).param_groups[0]["state_format"] == "stochastic4"  # the default 4-bit


@pytest.mark.parametrize("kwargs,bad", [
    ({"optim_bits": 8, "state_format": "blockwise4"}, "state_format='blockwise4' and optim_bits=8 disagree"),
    ({"optim_bits": 32, "state_format": "blockwise8"}, "state_format='blockwise8' and optim_bits=32 disagree"),
])
def test_state_format_and_optim_bits_that_disagree_are_one_error_naming_both(kwargs, bad):
    p = torch.nn.Parameter(torch.randn(8))
    with pytest.raises(ValueError, match=bad):
        hf_optim.Lion([p], **kwargs)
    agree = hf_optim.Lion([p], optim_bits=8, state_format="blockwise8")
    assert agree.param_groups[0]["state_format"] == "blockwise8"


def test_an_unknown_state_format_lists_the_names_and_the_closest_one():
    p = torch.nn.Parameter(torch.randn(8))
    with pytest.raises(ValueError, match=r"Invalid state_format: 'blockwise9'; expected one of 'fp32', "
                                         r".*'blockwise8'.*'blockwise4'.*did you mean 'blockwise8'\?"):
        hf_optim.AdamW([p], state_format="blockwise9")
    with pytest.raises(ValueError, match="Invalid state_format: 'blockwise4'; Adafactor runs with 'fp32', "
                                         "'blockwise8'"):
        hf_optim.Adafactor([p], lr=1e-3, relative_step=False, state_format="blockwise4")


@pytest.mark.parametrize("cls", [c for c in ALL_CLASSES if c not in BASES], ids=lambda cls: cls.__name__)
def test_a_fixed_format_class_accepts_its_own_name_and_refuses_another(cls):
    p = torch.nn.Parameter(torch.randn(64, 80))
    fixed = next((f for f in FORMATS.values() if cls.__name__.endswith(f.class_suffix)), None)
    if fixed is None:  # Paged<Algorithm>: any format
        assert build(cls, [p], state_format="blockwise8").param_groups[0]["state_format"] == "blockwise8"
        return
    assert "state_format" not in inspect.signature(cls.__init__).parameters  # bitsandbytes' signature
    assert build(cls, [p], state_format=fixed.name).param_groups[0]["state_format"] == fixed.name
    other = "fp32" if fixed.name != "fp32" else "blockwise8"
    with pytest.raises(ValueError, match=f"{cls.__name__} fixes state_format='{fixed.name}'; got state_format="):
        build(cls, [p], state_format=other)


def test_an_optim_bits_override_of_one_parameter_picks_its_alias_format():
    """bitsandbytes' per-parameter ``{"optim_bits": 32}`` (the Trainer's embeddings) still wins over the group's
    ``state_format``."""
    params = make_params([(64, 80), (64, 80), (64, 80)])
    setattr(params[1], PARAM_OVERRIDES_ATTR, {"optim_bits": 32})
    setattr(params[2], PARAM_OVERRIDES_ATTR, {"state_format": "blockwise8"})  # a name alone wins too
    opt = hf_optim.AdamW(params, state_format="blockwise4")
    run_steps(opt, params, 1)
    assert formats_of(opt) == ["blockwise4", "fp32", "blockwise8"]


def test_a_bitsandbytes_state_dict_without_state_format_loads_as_its_optim_bits():
    params = make_params([(64, 80)])
    saver = hf_optim.AdamW8bit(params)
    run_steps(saver, params, 1)
    saved = saver.state_dict()
    for group in saved["param_groups"]:
        del group["state_format"]  # as bitsandbytes (or hf_optim before state_format) writes it
    loader = hf_optim.AdamW(params)
    loader.load_state_dict(saved)
    assert loader.param_groups[0]["state_format"] == "blockwise8"
    run_steps(loader, params, 1, start=1)
    assert formats_of(loader) == ["blockwise8"]


class _Test8(Blockwise8):
    """A second 8-bit format (its own name, code and suffixes; no optim_bits alias): 8 bits no longer name a format."""

    name, code, class_suffix, optim_suffix, label, rank, optim_bits = (
        "test8", 99, "Test8", "test8", "8-bit test", 9, None)


@pytest.fixture
def test8():
    fmt = register_format(_Test8())
    try:
        yield fmt
    finally:
        del FORMATS[fmt.name]


def test_a_second_format_with_the_same_bits_registers_and_gets_trainer_names(test8):
    assert test8.bits == 8 and format_for_bits(8).name == "blockwise8"  # the alias still picks bitsandbytes' format
    assert parse_name("paged_adamw_test8") == (test8, True)
    adamw = registry.lookup_algorithm("adamw")
    names = trainer_names(adamw.algorithm, [*adamw.formats, test8], pages=True)
    assert {"adamw_test8", "paged_adamw_test8"} < set(names) and set(adamw.trainer_names) < set(names)
    with pytest.raises(ValueError, match="clashes with 'blockwise8' \\(optim_suffix\\)"):
        register_format(type("Again", (_Test8,), {"name": "again", "code": 98, "class_suffix": "Again",
                                                 "optim_suffix": "8bit"})())
    with pytest.raises(ValueError, match="clashes with 'blockwise8' \\(rank\\)"):  # tables would have no order
        register_format(type("Again", (_Test8,), {"name": "again", "code": 98, "class_suffix": "Again",
                                                 "optim_suffix": "again", "rank": 2})())
    with pytest.raises(ValueError, match="rank 1, which the planner keeps for torch's own state"):
        register_format(type("Again", (_Test8,), {"name": "again", "code": 98, "class_suffix": "Again",
                                                 "optim_suffix": "again", "rank": 1})())


@pytest.mark.parametrize("cls", BASES, ids=lambda cls: cls.__name__)
def test_every_class_documents_each_common_option_once(cls):
    doc = cls.__doc__
    for option in options.offered(cls):
        assert doc.count(f"        {option.name} (") == 1, option.name
    assert list(inspect.signature(cls.__init__).parameters)[-1] == "state_format"


def test_optim_args_cannot_change_what_the_name_chooses():
    with pytest.raises(OptimArgsError, match="'state_format': the optim name chooses the state format .* adamw_4bit"):
        typed_optim_args(OPTIMIZER_NAMES["adamw_8bit"], {"state_format": "blockwise4"})


def test_the_state_format_table_lists_every_registered_format():
    table = str(hf_optim.available_state_formats())
    listed = [line.split()[0] for line in table.splitlines()[1:]]
    assert listed == [fmt.name for fmt in sorted(FORMATS.values(), key=lambda fmt: fmt.rank)]
    assert {"fp32", "blockwise8", "blockwise4", "fp8", "rank1_4bit", "stochastic4"} <= set(listed)
    assert listed[0] == "fp32"
    assert isinstance(hf_optim.available_state_formats()[0], StateFormat)
    # bytes per element of a 2^20-element slot, from the formats' layouts: codes, an fp32 scale per block, the map
    n = 1 << 20
    expected = {"fp32": 4.0, "blockwise8": (n + 4 * n / 256 + 4 * 256) / n,
                "blockwise4": (n / 2 + 4 * n / 128 + 4 * 16) / n,
                # a second-moment slot of a 1-D parameter, seen as a (n / 128, 128) matrix: a scale per row and column
                "rank1_4bit": (n / 2 + 4 * (n / 128 + 128) + 4 * 16) / n,
                "fp8": (n + 4 * n / 256) / n,
                "stochastic4": (n / 2 + 4 * n / 64) / n}  # a scale per 64 elements; no map: its maps are arithmetic
    shown = {line.split()[0]: float(line.split()[-1]) for line in table.splitlines()[1:]}
    # the built-in formats against their layouts; a format registered later is priced by test_format_conformance
    assert {name: shown[name] for name in expected} == pytest.approx(expected, rel=1e-3)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert table in readme  # the README shows the table as it prints
