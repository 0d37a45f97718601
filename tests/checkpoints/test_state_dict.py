"""State dicts: round trips through torch.save/torch.load(weights_only=True), dtypes kept, bad dicts refused."""

import io

import pytest
import torch
from helpers import make_params, run_steps

import hf_optim
from hf_optim import StateDictError
from hf_optim.optim.base import QUANT_STATE_KEY


def save_and_load(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("cls", [hf_optim.AdamW8bit, hf_optim.AdEMAMix8bit, hf_optim.Lion8bit, hf_optim.LAMB8bit])
def test_state_dict_nests_quant_state_like_bitsandbytes(cls):
    params = make_params([(80, 70)])
    opt = cls(params)
    run_steps(opt, params, 1)
    saved = opt.state_dict()["state"][0]
    assert set(saved) == {"step", QUANT_STATE_KEY}
    assert {"state1", "qmap1", "absmax1"} <= set(saved[QUANT_STATE_KEY])
    assert saved["step"] == 1 and isinstance(saved["step"], int)


def test_flat_form_is_accepted():
    params = make_params([(80, 70)])
    opt = hf_optim.AdamW8bit(params)
    run_steps(opt, params, 2)
    state_dict = opt.state_dict()
    flat = {0: {"step": 2, **state_dict["state"][0][QUANT_STATE_KEY]}}
    other = hf_optim.AdamW8bit([torch.nn.Parameter(params[0].detach().clone())])
    other.load_state_dict({"state": flat, "param_groups": state_dict["param_groups"]})
    assert torch.equal(other.state[other.param_groups[0]["params"][0]]["state1"], opt.state[params[0]]["state1"])


def test_load_never_casts_state_to_the_parameter_dtype():
    params = make_params([(80, 70), (10,)], dtype=torch.bfloat16)
    opt = hf_optim.AdamW8bit(params)
    run_steps(opt, params, 2)
    loaded = save_and_load(opt.state_dict())
    fresh = hf_optim.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params])
    fresh.load_state_dict(loaded)
    big, small = (fresh.state[p] for p in fresh.param_groups[0]["params"])
    assert big["state1"].dtype == torch.uint8 and big["state2"].dtype == torch.uint8
    assert big["absmax1"].dtype == torch.float32 and big["qmap1"].dtype == torch.float32
    assert small["state1"].dtype == torch.float32  # fp32 state under min_8bit_size, not bf16


def trained_state_dict(cls, shapes=((80, 70),), **kwargs):
    params = make_params(shapes)
    opt = cls(params, **kwargs)
    run_steps(opt, params, 2)
    return opt.state_dict()


@pytest.mark.parametrize(
    "saved_by,loaded_by,message",
    [
        (hf_optim.Lion8bit, hf_optim.AdamW8bit, "saved by hf_optim's 'lion'"),
        (hf_optim.AdamW8bit, hf_optim.Lion8bit, "saved by hf_optim's 'adamw'"),
        (hf_optim.AdEMAMix8bit, hf_optim.AdamW8bit, "saved by hf_optim's 'ademamix'"),
        (hf_optim.AdamW8bit, hf_optim.AdEMAMix8bit, "saved by hf_optim's 'adamw'"),
        (hf_optim.LAMB8bit, hf_optim.AdamW8bit, "saved by hf_optim's 'lamb'"),
        (hf_optim.AdamW, hf_optim.Adafactor, "saved by hf_optim's 'adamw'"),
    ],
)
def test_state_dict_of_another_algorithm_is_refused(saved_by, loaded_by, message):
    saved = trained_state_dict(saved_by)
    target = loaded_by(make_params([(80, 70)]))
    with pytest.raises(StateDictError, match=message):
        target.load_state_dict(saved)


@pytest.mark.parametrize(
    "saved_by,loaded_by,message",
    [
        (hf_optim.AdEMAMix8bit, hf_optim.AdamW8bit, "saved by AdEMAMix"),
        (hf_optim.Lion8bit, hf_optim.AdamW8bit, "saved by another algorithm"),
        (hf_optim.AdamW8bit, hf_optim.RMSprop8bit, "saved by another algorithm"),
        (hf_optim.AdamW, hf_optim.AdEMAMix, "expected \\(2, 80, 70\\)"),
    ],
)
def test_foreign_state_without_algorithm_tag_is_checked_by_layout(saved_by, loaded_by, message):
    """bitsandbytes' state dicts carry no algorithm name: the layout itself must give the mismatch away."""
    saved = trained_state_dict(saved_by)
    for group in saved["param_groups"]:
        group.pop("hf_optim_algorithm")
    with pytest.raises(StateDictError, match=message):
        loaded_by(make_params([(80, 70)])).load_state_dict(saved)


def test_old_2048_block_size_is_refused_with_a_clear_error():
    saved = trained_state_dict(hf_optim.AdamW8bit)
    quant = saved["state"][0][QUANT_STATE_KEY]
    n = 80 * 70
    quant["absmax1"] = torch.ones(-(-n // 2048))
    quant["absmax2"] = torch.ones(-(-n // 2048))
    with pytest.raises(StateDictError, match="2048-element blocks of bitsandbytes <= 0.43"):
        hf_optim.AdamW8bit(make_params([(80, 70)])).load_state_dict(saved)


def test_other_parameter_layout_is_refused():
    saved = trained_state_dict(hf_optim.AdamW8bit)
    with pytest.raises(StateDictError, match="expected \\(70, 80\\)"):
        hf_optim.AdamW8bit(make_params([(70, 80)])).load_state_dict(saved)
    with pytest.raises(StateDictError, match="has 2 parameters, the state dict's has 1"):
        hf_optim.AdamW8bit(make_params([(80, 70), (3,)])).load_state_dict(saved)


def test_wrong_quantization_map_is_refused():
    saved = trained_state_dict(hf_optim.AdamW8bit)
    quant = saved["state"][0][QUANT_STATE_KEY]
    quant["qmap1"], quant["qmap2"] = quant["qmap2"], quant["qmap1"]
    with pytest.raises(StateDictError, match="not the signed dynamic map"):
        hf_optim.AdamW8bit(make_params([(80, 70)])).load_state_dict(saved)


def test_loaded_hyperparameters_are_validated_and_missing_ones_filled():
    saved = trained_state_dict(hf_optim.LAMB8bit)
    group = saved["param_groups"][0]
    del group["use_nvlamb"]  # e.g. a state dict from an older release
    opt = hf_optim.LAMB8bit(make_params([(80, 70)]))
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["use_nvlamb"] is False
    saved["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        opt.load_state_dict(saved)


def test_loading_copies_so_two_optimizers_never_share_state():
    params = make_params([(80, 70)])
    opt = hf_optim.AdamW8bit(params)
    run_steps(opt, params, 2)
    saved = opt.state_dict()
    codes_before = saved["state"][0][QUANT_STATE_KEY]["state1"].clone()
    twin_params = [torch.nn.Parameter(params[0].detach().clone())]
    twin = hf_optim.AdamW8bit(twin_params)
    twin.load_state_dict(saved)
    run_steps(twin, twin_params, 1, start=2)
    assert torch.equal(saved["state"][0][QUANT_STATE_KEY]["state1"], codes_before)
    assert torch.equal(opt.state[params[0]]["state1"], codes_before)


def test_torch_and_torchao_adamw_state_dicts_are_refused_with_the_reason():
    """torch's AdamW (and torchao's AdamW4bit/8bit, which keep torch's keys with tensor-subclass values) save
    ``exp_avg``/``exp_avg_sq``: loading that into AdamW4bit says whose state it is and why it is not converted."""
    params = [torch.nn.Parameter(torch.randn(64, 80))]
    torch_opt = torch.optim.AdamW(params, lr=1e-3)
    params[0].grad = torch.randn_like(params[0])
    torch_opt.step()
    ours = hf_optim.AdamW4bit([torch.nn.Parameter(params[0].detach().clone())])
    with pytest.raises(StateDictError, match=r"torch.optim.AdamW .*exp_avg|exp_avg.*torch.optim.AdamW"):
        ours.load_state_dict(torch_opt.state_dict())

    class OptimState4bit(torch.Tensor):  # the name torchao's 4-bit state subclass has
        pass

    saved = torch_opt.state_dict()
    saved["state"][0]["exp_avg"] = saved["state"][0]["exp_avg"].as_subclass(OptimState4bit)
    refused = r"torchao's low-bit AdamW \(OptimState4bit state\).*need torchao installed"
    with pytest.raises(StateDictError, match=refused):
        ours.load_state_dict(saved)


@pytest.mark.parametrize("records_format", [True, False], ids=["state_format", "optim_bits-only"])
def test_a_checkpoint_of_the_former_4bit_default_resumes_in_its_format(records_format):
    """``AdamW4bit`` stored ``blockwise4`` state before ``stochastic4`` became the default 4-bit format. Such a
    checkpoint (param groups with ``state_format='blockwise4'``, or, from an older hf_optim, only ``optim_bits=4``)
    loads into today's ``AdamW4bit`` and resumes in ``blockwise4``, bit for bit as ``AdamW4bitBlockwise`` (that
    format's class today) continues it: nothing is converted or lost."""
    params = make_params([(80, 70), (4100,)])
    old = hf_optim.AdamW4bitBlockwise(params)  # what AdamW4bit saved: blockwise4 state, optim_bits 4
    run_steps(old, params, 2)
    saved = save_and_load(old.state_dict())
    assert [g["optim_bits"] for g in saved["param_groups"]] == [4]
    if not records_format:
        for group in saved["param_groups"]:
            del group["state_format"]
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = hf_optim.AdamW4bit(resumed_params)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["state_format"] == "blockwise4"
    run_steps(old, params, 2, start=2)
    run_steps(resumed, resumed_params, 2, start=2)
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)
        for key, value in old.state[p].items():
            assert torch.equal(value, resumed.state[q][key]) if isinstance(value, torch.Tensor) else \
                value == resumed.state[q][key]
