"""What the registry-driven conformance suites do not cover for the ``fp8`` state format: its Triton software
conversions against torch's float8 casts bit for bit, the Trainer's ``optim=`` names through transformers, and the
CPU compiled step against the eager one. (Round trips, state dicts, resume, estimator bytes and the interpreter twin
of the fused kernel run in tests/test_format_conformance.py and tests/test_algorithm_conformance.py.)"""

from __future__ import annotations

import pytest
import torch
from test_triton_kernels import use_triton  # noqa: F401 (fixture)

import hf_optim
from hf_optim.kernels.formats import FP8, format_named
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
