"""hf_optim.state_memory against bytes computed by hand from the state format (spec section 1)."""

import math

import pytest
import torch
from helpers import make_params, run_steps

import hf_optim


def test_8bit_adamw_is_two_bytes_per_element_plus_absmax_and_maps():
    shapes = [(64, 128), (300, 100), (10,)]  # two 8-bit tensors (one with a partial block), one small fp32 one
    params = make_params(shapes)
    opt = hf_optim.AdamW8bit(params)
    run_steps(opt, params, 1)
    expected_uint8 = 2 * (64 * 128 + 300 * 100)
    blocks = math.ceil(64 * 128 / 256) + math.ceil(300 * 100 / 256)
    expected_fp32 = 2 * 4 * blocks + 2 * 2 * 256 * 4 + 2 * 10 * 4  # absmax1/2, qmap1/2 per tensor, small tensor
    memory = hf_optim.state_memory(opt)
    assert memory.by_dtype == {"uint8": expected_uint8, "float32": expected_fp32}
    assert memory.total_bytes == expected_uint8 + expected_fp32
    assert memory.by_device == {"cpu": memory.total_bytes}
    assert memory.paged_bytes == 0


def test_32bit_and_torch_optimizers_count_every_state_tensor():
    params = make_params([(64, 64)])
    ours = hf_optim.AdamW32bit(params)
    run_steps(ours, params, 1)
    assert hf_optim.state_memory(ours).as_dict() == {
        "total_bytes": 2 * 64 * 64 * 4, "by_dtype": {"float32": 2 * 64 * 64 * 4},
        "by_device": {"cpu": 2 * 64 * 64 * 4}, "paged_bytes": 0, "num_params": 64 * 64, "bytes_per_param": 8.0,
    }
    theirs = torch.optim.AdamW(params)
    run_steps(theirs, params, 1)
    # torch keeps m and v (fp32) and a 0-d fp32 step tensor per parameter.
    assert hf_optim.state_memory(theirs).total_bytes == 2 * 64 * 64 * 4 + 4


def test_empty_before_the_first_step():
    opt = hf_optim.Lion8bit(make_params([(64, 64)]))
    assert hf_optim.state_memory(opt).total_bytes == 0


@pytest.mark.parametrize("cls,block,map_bytes", [(hf_optim.AdamW4bit, 64, 0),
                                                 (hf_optim.AdamW4bitBlockwise, 128, 4 * 16)],
                         ids=["stochastic4", "blockwise4"])
def test_bytes_per_param_of_4bit_state_by_hand(cls, block, map_bytes):
    """Two 4-bit slots: codes, an fp32 scale per block (64 elements for stochastic4, 128 for blockwise4) and
    blockwise4's 16-entry maps (stochastic4 keeps none)."""
    params = make_params([(128, 256)])  # 32768 elements
    opt = cls(params)
    run_steps(opt, params, 1)
    memory = hf_optim.state_memory(opt)
    numel = 128 * 256
    assert memory.num_params == numel
    assert memory.bytes_per_param == 2 * (numel // 2 + 4 * (numel // block) + map_bytes) / numel
