"""What the registry-driven conformance suites do not cover for the ``fp8`` state format: its Triton software
conversions against torch's float8 casts bit for bit, the Trainer's ``optim=`` names through transformers, and the
CPU compiled step against the eager one. (Round trips, state dicts, resume, estimator bytes and the interpreter twin
of the fused kernel run in tests/formats/test_format_conformance.py and
tests/algorithms/test_algorithm_conformance.py.)"""

from __future__ import annotations

import pytest
import torch

import hf_optim
from hf_optim.formats import FP8, format_named
from hf_optim.formats import fp8 as fp8_format
from hf_optim.kernels.torch_path import cpu_compile, multi_tensor


def e4m3_boundaries() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours, each +-3 fp32 ulps, both signs, within
    [-448, 448] (the range the encoder gets after the clamp); midpoints are where ties-to-even decides."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    values = values[values.isfinite()].unique()
    points = torch.cat([values, (values[1:] + values[:-1]) / 2]).float()
    bits = points.view(torch.int32)
    near = torch.cat([(bits + d).view(torch.float32) for d in range(-3, 4)])
    near = near[near.abs() <= 448]
    return torch.cat([near, -near, torch.tensor([0.0, -0.0, 448.0, -448.0, 2.0**-10, 3 * 2.0**-10])])


def test_software_conversions_equal_torch_casts(use_triton):  # noqa: F811
    from hf_optim.kernels.triton_path import fp8 as triton_fp8

    codes = torch.arange(256, dtype=torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).float()
    decoded = triton_fp8.convert(codes, encode=False)
    finite = expected.isfinite()  # 0x7F and 0xFF are NaN, never stored
    assert torch.equal(decoded[finite].view(torch.int32), expected[finite].view(torch.int32))
    values = e4m3_boundaries()
    encoded = triton_fp8.convert(values, encode=True)
    reference = values.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(encoded, reference), f"{int((encoded != reference).sum())} of {values.numel()} codes differ"


def torch_stochastic_codes(values: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes of non-negative ``values`` (<= 448) rounded stochastically by the PyTorch format (flat: element
    ``i`` in lane ``i % 256``)."""
    pad = -values.numel() % 256
    blocked = torch.cat([values, values.new_zeros(pad)]).view(1, -1, 256)
    return fp8_format._round_e4m3_stochastically(blocked).flatten()[: values.numel()].to(torch.float8_e4m3fn)


def stochastic_inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    boundaries = e4m3_boundaries()
    spread = torch.exp2(torch.rand(8192, generator=gen) * 20 - 11).clamp_max(448.0)  # subnormals to 448
    return torch.cat([boundaries[boundaries >= 0], spread])


def test_stochastic_rounding_is_exact_unbiased_and_its_triton_twin_equal(use_triton):  # noqa: F811
    from hf_optim.kernels.triton_path import fp8 as triton_fp8

    values = stochastic_inputs()
    codes = torch_stochastic_codes(values)
    decoded = codes.float()
    # each value goes to one of its two e4m3 neighbours (the rounded value is exact in e4m3: the cast keeps it)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()
    above = torch.searchsorted(grid, values).clamp_max(grid.numel() - 1)
    below = torch.searchsorted(grid, values, right=True) - 1
    assert torch.all((decoded == grid[above]) | (decoded == grid[below]))
    exact = grid[above] == values
    assert torch.equal(decoded[exact], values[exact])
    # unbiased: the mean relative rounding error of many values is far below rounding to nearest's worst (1/16)
    inside = ~exact & (values > 2.0**-6)
    relative = (decoded[inside] - values[inside]) / values[inside]
    assert relative.abs().max() > 0.05 and abs(float(relative.mean())) < 2e-3
    # the Triton twin (the integer conversion after the stochastic step) draws the same bits
    triton_codes = triton_fp8.convert(values, encode=True, stochastic=True)
    assert torch.equal(triton_codes, codes.view(torch.uint8))


def test_second_moment_keeps_beta2_decay():
    """The reason v is rounded stochastically: elements with no gradient under a block maximum that keeps moving
    must decay as ``beta2**t``; rounded to nearest, ``0.999 * v`` rounds back to ``v`` and they never do."""
    def decayed(fmt, steps=700):
        gen = torch.Generator().manual_seed(1)
        v0 = torch.exp2(torch.rand(1, 4096, generator=gen) * -10)
        v0[:, ::256] = 1.0  # each block's maximum, fed a noisy squared gradient every step
        codes = torch.zeros(1, 4096, dtype=torch.float8_e4m3fn)
        absmax = torch.zeros(1, 16)
        fmt.store(v0, [codes, absmax], False)
        for _ in range(steps):
            v = fmt.dequantize([codes, absmax], False, 4096)
            g2 = torch.zeros_like(v)
            g2[:, ::256] = 0.5 + torch.rand(1, 16, generator=gen)
            fmt.store(0.999 * v + 0.001 * g2, [codes, absmax], False)
        v = fmt.dequantize([codes, absmax], False, 4096)
        others = torch.ones(4096, dtype=torch.bool)
        others[::256] = False
        return float((v[0, others] / v0[0, others]).mean())

    expected = 0.999**700
    assert abs(decayed(FP8) / expected - 1) < 0.03
    assert decayed(fp8_format.variant("e4m3")) > 0.9  # rounded to nearest: stuck


@pytest.mark.filterwarnings("ignore:hf_optim. paged optimizers")
@pytest.mark.parametrize("name,cls", [("adamw_fp8", hf_optim.AdamWFp8), ("paged_adamw_fp8", hf_optim.PagedAdamWFp8),
                                      ("ademamix_fp8", hf_optim.AdEMAMixFp8), ("lion_fp8", hf_optim.LionFp8),
                                      ("paged_lion_fp8", hf_optim.PagedLionFp8)])
def test_training_arguments_name_builds_the_fp8_class(name, cls, tmp_path):
    from transformers import Trainer, TrainingArguments

    built, kwargs = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(output_dir=str(tmp_path), optim=name))
    assert built is cls
    param = torch.nn.Parameter(torch.zeros(4096))
    opt = built([param], **kwargs)
    assert format_named(opt.param_groups[0]["state_format"]) is FP8
    param.grad = torch.ones_like(param)
    opt.step()
    assert opt.state[param]["state1"].dtype == torch.float8_e4m3fn


def test_compiled_cpu_step_equals_the_eager_step(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(multi_tensor, "CHUNK", 2048)
    monkeypatch.setattr(multi_tensor, "IN_PLACE_MIN", 4096)

    def run(mode: str):
        monkeypatch.setenv("HF_OPTIM_COMPILE", mode)
        cpu_compile.forget()
        gen = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((70, 90), (5000,), (33,))]
        opt = hf_optim.AdamWFp8(params, lr=1e-2, weight_decay=0.01)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) * torch.logspace(-6, 1, p.numel()).view(p.shape)
            opt.step()
        return params, opt

    eager_params, eager = run("0")
    params, opt = run("1")
    assert cpu_compile._entries, "nothing was compiled"
    cpu_compile.forget()
    for ref, p in zip(eager_params, params):
        assert torch.equal(p, ref)
        for key, value in eager.state[ref].items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == opt.state[p][key].dtype and torch.equal(value, opt.state[p][key]), key


@pytest.mark.gpu
@pytest.mark.parametrize("native", [False, True], ids=["software", "native"])
def test_gpu_conversions_equal_torch_casts(native):
    from hf_optim.kernels.triton_path import fp8 as triton_fp8

    major, minor = torch.cuda.get_device_capability()
    if native and major * 10 + minor < 89:
        pytest.skip("float8 conversion instructions need sm_89 or later (the software path runs there)")
    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    expected = codes.view(torch.float8_e4m3fn).float()
    decoded = triton_fp8.convert(codes, encode=False, native=native)
    finite = expected.isfinite()
    wrong = finite & (decoded.view(torch.int32) != expected.view(torch.int32))
    assert not wrong.any(), [(hex(c), d, e) for c, d, e in zip(codes[wrong].tolist(), decoded[wrong].tolist(),
                                                               expected[wrong].tolist())][:8]
    values = e4m3_boundaries().cuda()
    encoded = triton_fp8.convert(values, encode=True, native=native)
    reference = values.to(torch.float8_e4m3fn).view(torch.uint8)
    wrong = encoded != reference
    assert not wrong.any(), [(v, hex(c), hex(r)) for v, c, r in zip(values[wrong].tolist(), encoded[wrong].tolist(),
                                                                    reference[wrong].tolist())][:8]
    values = stochastic_inputs()
    encoded = triton_fp8.convert(values.cuda(), encode=True, native=native, stochastic=True)
    assert torch.equal(encoded.cpu(), torch_stochastic_codes(values).view(torch.uint8))
