"""The 8-bit dynamic maps are constants of the package, independent of torch's kernels (issue 31).

References, each independent of the constants:
- the spec's construction (docs: /work/shared/spec/optimizers.md §1 and §11) evaluated exactly, in float64 and
  rationals, as torch's CPU ``linspace`` kernel evaluates it in fp32: ``start + step * i`` below the halfway point,
  ``end - step * (steps - 1 - i)`` above it, rounded once (FMA kernels) or twice (kernels without FMA);
- the closed form in exact rationals, with an error bound derived from fp32 rounding;
- bitsandbytes' own ``create_dynamic_map``, in this process and under ``ATEN_CPU_CAPABILITY=default`` (torch's
  kernels without FMA);
- bitsandbytes' ``AdamW8bit`` saving and loading checkpoints across the two kinds of kernels.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from fractions import Fraction

import bitsandbytes.functional as bnbF
import numpy as np
import pytest
import torch

import hf_optim
from hf_optim.formats.base import StateDictError
from hf_optim.formats.blockwise8 import MAP_ULP_TOLERANCE
from hf_optim.formats.dynamic_map import (
    SIGNED_MAP_BITS,
    UNSIGNED_MAP_BITS,
    create_dynamic_map,
    dynamic_map,
)

SIGNS = pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per entry, the number of fp32 values from ``a`` to ``b``: their int32 views, made monotonic in value."""

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return (ordered(a) - ordered(b)).abs()


# ---------------------------------------------------------------------------------------------------------------
# The spec's construction, evaluated as torch's CPU kernels do, without torch
def _linspace_fp32(items: int, single_rounding: bool) -> np.ndarray:
    """``torch.linspace(0.1, 1, items, dtype=float32)`` of torch's CPU kernel (RangeFactoriesKernel.cpp, scalar
    since torch 2.0). With ``single_rounding`` ``start + step * i`` rounds once (the fused multiply-add that the
    AVX2 and AVX-512 builds contract it to); otherwise the product rounds first. The float64 sums are exact (a
    24-bit step times i < 2**8 plus 0.1's 24 bits spans fewer than 53 bits), so np.float32() is the one rounding."""
    f32 = np.float32
    start, end = f32(0.1), f32(1.0)
    step = f32(f32(end - start) / f32(items - 1))
    out = []
    for i in range(items):
        base, count, sign = (start, i, 1.0) if i < items // 2 else (end, items - 1 - i, -1.0)
        if single_rounding:
            out.append(f32(np.float64(base) + sign * np.float64(step) * count))
        else:
            out.append(f32(base + f32(sign) * f32(step * f32(count))))
    return np.array(out, dtype=f32)


def construction(signed: bool, single_rounding: bool) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map`` step by step in numpy fp32 (numpy rounds every operation once)."""
    f32 = np.float32
    values = []
    for decade in range(7):
        bounds = _linspace_fp32(2**decade + 1 if signed else 2 ** (decade + 1) + 1, single_rounding)
        means = (bounds[:-1] + bounds[1:]) / f32(2)
        scale = f32(10.0 ** (decade - 6))  # torch multiplies an fp32 tensor by a Python scalar in fp32
        values += list(scale * means) + (list(-scale * means) if signed else [])
    values += [f32(0), f32(1)]
    return torch.from_numpy(np.sort(np.array(values, dtype=f32)))


@SIGNS
def test_constants_are_the_single_rounding_construction(signed):
    """Bit for bit the spec's construction with each linspace bound rounded once, as the FMA kernels round it."""
    ours = create_dynamic_map(signed)
    assert torch.equal(ours.view(torch.int32), construction(signed, single_rounding=True).view(torch.int32))
    bits = SIGNED_MAP_BITS if signed else UNSIGNED_MAP_BITS
    assert len(bits) == 256 and [b & 0xFFFFFFFF for b in ours.view(torch.int32).tolist()] == list(bits)


@SIGNS
def test_double_rounding_construction_is_within_the_load_tolerance(signed):
    """The other evaluation torch's kernels have (no FMA) lies within MAP_ULP_TOLERANCE of the constants, so a
    checkpoint from such kernels loads; the constants' module docstring tells which entries differ and why."""
    other = construction(signed, single_rounding=False)
    assert int(ulps(other, create_dynamic_map(signed)).max()) <= MAP_ULP_TOLERANCE


@SIGNS
def test_constants_have_the_spec_landmarks(signed):
    qmap = create_dynamic_map(signed)
    assert qmap.dtype == torch.float32 and qmap.shape == (256,)
    assert bool((qmap[1:] > qmap[:-1]).all())  # sorted, all distinct
    assert qmap[255] == 1.0 and bool((qmap == 0).any())
    if signed:
        assert qmap[127] == 0.0 and qmap[0] == pytest.approx(-0.99297, abs=1e-5)
        assert torch.equal(qmap[:127], -qmap[128:255].flip(0))  # codes 0..126 mirror 254..128
        assert qmap[128] == pytest.approx(5.5e-7, rel=1e-6)
    else:
        assert qmap[0] == 0.0 and bool((qmap >= 0).all()) and qmap[1] == pytest.approx(3.25e-7, rel=1e-6)


def _error_bound(decade: int, n: int, k: int) -> Fraction:
    """Largest |fp32 construction - exact value| of the map value from interval k of n in ``decade``, for either
    rounding of the linspace bounds. u = 2**-24 bounds every fp32 rounding relative to its result:
    - start = fl(0.1) is off by ds <= 2**-28 (half an ulp of 0.1); D = fl(1 - start) by ds + 2**-25;
      step = fl(D / n) by u / n more, so ``es`` below bounds |step - 0.9 / n|;
    - bound j: below halfway start + step * j, off by ds + j * es, above it 1 - step * (n - j), off by (n - j) * es;
      plus its rounding (u: the bound is <= 1) and, without FMA, the product's (u * j / n);
    - the midpoint: the two bounds' mean error, plus the sum's rounding halved (sum <= 2: u);
    - the scale: 10**(decade - 6) rounded to double then fp32 (u + 2**-53 relative), and the product rounded (u)."""
    u, ds = Fraction(1, 2**24), Fraction(1, 2**28)
    es = (ds + Fraction(1, 2**25)) / n + u / n
    halfway = (n + 1) // 2

    def bound_error(j: int) -> Fraction:
        count = j if j < halfway else n - j
        return (ds if j < halfway else 0) + count * es + u + u * Fraction(count, n)

    exact_mid = Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * k + 1, 2 * n)
    mid_error = (bound_error(k) + bound_error(k + 1)) / 2 + u
    scale = Fraction(10) ** (decade - 6)
    scale_error = 0 if decade == 6 else u + Fraction(1, 2**53)
    return scale * (mid_error + (scale_error + u + scale_error * u) * (exact_mid + mid_error))


@SIGNS
def test_constants_are_the_closed_form_within_fp32_rounding(signed):
    """Each entry lies within the derived rounding bound of its exact value 10**(e-6) * (0.1 + 0.9 (k + 1/2) / n)
    (n = 2**e intervals in decade e, 2**(e+1) unsigned). The bound reaches a few ulp (the linspace bounds carry
    0.1's rounding and the step's), while neighbouring entries are >= 0.7% (about 2**16 ulp) apart, so a wrong
    decade, interval or sign fails."""
    exact, bounds = [Fraction(0), Fraction(1)], [Fraction(0), Fraction(0)]
    for decade in range(7):
        n = 2**decade if signed else 2 ** (decade + 1)
        for k in range(n):
            value = Fraction(10) ** (decade - 6) * (Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * k + 1, 2 * n))
            for sign in (1, -1) if signed else (1,):
                exact.append(sign * value)
                bounds.append(_error_bound(decade, n, k))
    order = sorted(range(256), key=lambda i: exact[i])
    ours = create_dynamic_map(signed).tolist()
    for position, i in enumerate(order):
        assert abs(Fraction(ours[position]) - exact[i]) <= bounds[i], (position, ours[position], float(exact[i]))


# ---------------------------------------------------------------------------------------------------------------
# Against bitsandbytes
_BNB_MAPS = """
import json, torch, bitsandbytes.functional as F
maps = {s: F.create_dynamic_map(signed=s).view(torch.int32).tolist() for s in (True, False)}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "signed": maps[True],
                  "unsigned": maps[False]}))
"""


def _env(capability: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    return env


def _run(code: str, *args: str, capability: str | None) -> dict:
    result = subprocess.run([sys.executable, "-c", code, *args], env=_env(capability), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@SIGNS
def test_bitsandbytes_map_equals_the_constants_under_this_process_kernels(signed):
    """On x86 torch picks FMA kernels (AVX2, AVX-512) unless told ATEN_CPU_CAPABILITY=default, and the
    constants are what bitsandbytes builds there, bit for bit. Under kernels without FMA the next test applies."""
    theirs = bnbF.create_dynamic_map(signed=signed)
    if X86 and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        assert int(ulps(theirs, create_dynamic_map(signed)).max()) <= MAP_ULP_TOLERANCE
    else:
        assert torch.equal(theirs.view(torch.int32), create_dynamic_map(signed).view(torch.int32))


@pytest.mark.slow  # a subprocess importing torch and bitsandbytes
def test_bitsandbytes_map_without_fma_kernels_is_within_the_tolerance():
    """torch's kernels without FMA (ATEN_CPU_CAPABILITY=default, in a subprocess): bitsandbytes' maps are the
    double-rounding construction bit for bit, so within MAP_ULP_TOLERANCE of ours in every entry."""
    found = _run(_BNB_MAPS, capability="default")
    assert found["capability"] == "DEFAULT"  # the variable took effect
    for signed, key in ((True, "signed"), (False, "unsigned")):
        theirs = torch.tensor(found[key], dtype=torch.int32).view(torch.float32)
        assert torch.equal(theirs.view(torch.int32), construction(signed, single_rounding=False).view(torch.int32))
        assert int(ulps(theirs, create_dynamic_map(signed)).max()) <= MAP_ULP_TOLERANCE


# ---------------------------------------------------------------------------------------------------------------
# Loading a checkpoint whose maps differ
def _trained(steps: int = 2, shapes=((5000,), (64, 96), (4096,))):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = hf_optim.AdamW8bit(params, lr=1e-2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def _map_records(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if "dynamic map" in r.getMessage()]


def test_maps_from_kernels_without_fma_load_with_one_line_and_continue_on_ours(hf_optim_records):
    params, opt = _trained()
    saved = opt.state_dict()
    no_fma = {"qmap1": construction(True, False), "qmap2": construction(False, False)}
    for state in saved["state"].values():
        state["__bnb_optimizer_quant_state__"].update({k: v.clone() for k, v in no_fma.items()})
    fresh = hf_optim.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    fresh.load_state_dict(saved)
    records = _map_records(hf_optim_records)
    assert len(records) == 1, [r.getMessage() for r in records]  # one line per load, not one per parameter
    assert records[0].levelno == logging.INFO and "6 loaded dynamic map(s)" in records[0].getMessage()
    for p, state in zip(fresh.param_groups[0]["params"], saved["state"].values()):
        loaded = fresh.state[p]
        assert torch.equal(loaded["qmap1"].view(torch.int32), dynamic_map(True).view(torch.int32))
        assert torch.equal(loaded["qmap2"].view(torch.int32), dynamic_map(False).view(torch.int32))
        quant = state["__bnb_optimizer_quant_state__"]
        assert torch.equal(loaded["state1"], quant["state1"]) and torch.equal(loaded["state2"], quant["state2"])
        assert torch.equal(quant["qmap1"], no_fma["qmap1"])  # the caller's state dict is left as it was
    for p in fresh.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    fresh.step()


def test_a_load_that_matches_our_maps_logs_nothing(hf_optim_records):
    _, opt = _trained(steps=1)
    opt.load_state_dict(opt.state_dict())
    assert _map_records(hf_optim_records) == []


def _off_by(ulp_count: int, at: int) -> torch.Tensor:
    qmap = dynamic_map(True)
    bits = qmap.view(torch.int32)
    bits[at] += ulp_count  # a positive entry: one int32 step is one fp32 ulp
    return qmap


@pytest.mark.parametrize("qmap,message", [
    (_off_by(MAP_ULP_TOLERANCE + 1, 200), rf"entry 200 is .*\({MAP_ULP_TOLERANCE + 1} ulp apart\)"),
    (dynamic_map(False), r"not the signed dynamic map .*\(it is the unsigned map\)"),
    (dynamic_map(True).to(torch.bfloat16), r"differ by more than"),
    (dynamic_map(True)[:255], r"has shape \(255,\), expected the 256-entry signed dynamic map"),
    (torch.cat([dynamic_map(True)[:255], torch.tensor([float("nan")])]), r"non-finite entries \(entry 255 is nan\)"),
], ids=["off-by-more", "other-map", "bf16", "short", "nan"])
def test_a_different_map_is_refused_by_parameter_and_distance(qmap, message, hf_optim_records):
    params, opt = _trained(steps=1, shapes=((64, 96),))
    saved = opt.state_dict()
    saved["state"][0]["__bnb_optimizer_quant_state__"]["qmap1"] = qmap
    fresh = hf_optim.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    with pytest.raises(StateDictError) as raised:
        fresh.load_state_dict(saved)
    assert str(raised.value).startswith("state of parameter 0 (shape (64, 96)): qmap1 ")
    assert raised.match(message)
    assert _map_records(hf_optim_records) == []  # the load did not happen: nothing logged


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints across kernels, in processes with and without ATEN_CPU_CAPABILITY=default
_CHECKPOINTS = r"""
import json, logging, sys, torch, bitsandbytes as bnb, hf_optim
mode, folder = sys.argv[1], sys.argv[2]
SHAPES, CLASSES = [(5000,), (64, 96)], {"hf_optim": hf_optim.AdamW8bit, "bnb": bnb.optim.AdamW8bit}
KWARGS = dict(lr=1e-2, weight_decay=0.1)

def grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)

found = {"capability": torch.backends.cpu.get_cpu_capability()}
if mode == "save":
    for saver, cls in CLASSES.items():
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
        opt = cls(params, **KWARGS)
        for step in range(3):
            grads(params, step)
            opt.step()
        torch.save({"state": opt.state_dict(), "params": [p.detach() for p in params]}, f"{folder}/{saver}.pt")
else:
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("hf_optim").addHandler(handler)
    logging.getLogger("hf_optim").setLevel(logging.INFO)
    for saver in CLASSES:
        saved = torch.load(f"{folder}/{saver}.pt", weights_only=True)
        for loader, cls in CLASSES.items():
            params = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
            opt = cls(params, **KWARGS)
            lines.clear()
            try:
                opt.load_state_dict(saved["state"])
            except Exception as error:
                found[f"{saver}->{loader}"] = {"error": f"{type(error).__name__}: {error}"}
                continue
            loaded = opt.state_dict()
            grads(params, 3)
            opt.step()
            torch.save({"loaded": loaded, "params": [p.detach() for p in params]}, f"{folder}/{saver}-{loader}.pt")
            found[f"{saver}->{loader}"] = {"map_lines": [line for line in lines if "dynamic map" in line]}
print(json.dumps(found))
"""


def _quant(state: dict) -> dict:
    return state.get("__bnb_optimizer_quant_state__", state)


def _decoded(quant: dict, suffix: str) -> torch.Tensor:
    codes, absmax = quant["state" + suffix].flatten().long(), quant["absmax" + suffix]
    return quant["qmap" + suffix][codes] * absmax.repeat_interleave(256)[: codes.numel()]


@pytest.mark.slow
@pytest.mark.parametrize("save_isa,load_isa", [("default", None), (None, "default")],
                         ids=["saved-without-fma->loaded-native", "saved-native->loaded-without-fma"])
def test_checkpoints_move_between_kernels_with_and_without_fma(save_isa, load_isa, tmp_path):
    """hf_optim's and bitsandbytes' AdamW8bit save under one kind of torch kernels and load, into both, under the
    other. Every load succeeds; hf_optim's loaded state is on our maps, its decoded values within
    MAP_ULP_TOLERANCE ulp of the checkpoint's (plus the product's rounding); after one more step both loaders agree
    as in test_bitsandbytes_interop (atol 1e-6: both apply the same fp32 update to the same decoded state)."""
    saved = _run(_CHECKPOINTS, "save", str(tmp_path), capability=save_isa)
    loaded = _run(_CHECKPOINTS, "load", str(tmp_path), capability=load_isa)
    assert (saved["capability"] == "DEFAULT") == (save_isa == "default")
    assert (loaded["capability"] == "DEFAULT") == (load_isa == "default")
    print(f"\nsaved under {saved['capability']}, loaded under {loaded['capability']}:")
    for saver in ("hf_optim", "bnb"):
        checkpoint = torch.load(tmp_path / f"{saver}.pt", weights_only=True)["state"]
        after = {}
        for loader in ("hf_optim", "bnb"):
            result = loaded[f"{saver}->{loader}"]
            print(f"  {saver} checkpoint -> {loader}: {result}")
            assert "error" not in result, result
            after[loader] = torch.load(tmp_path / f"{saver}-{loader}.pt", weights_only=True)
        # Which loads note a map: only hf_optim's, of bitsandbytes' map built without FMA (hf_optim saves constants).
        expect_line = saver == "bnb" and save_isa == "default"
        assert len(loaded[f"{saver}->hf_optim"]["map_lines"]) == (1 if expect_line else 0)
        for index, state in after["hf_optim"]["loaded"]["state"].items():
            ours, theirs = _quant(state), _quant(checkpoint["state"][index])
            for suffix, signed in (("1", True), ("2", False)):
                assert torch.equal(ours["qmap" + suffix].view(torch.int32), dynamic_map(signed).view(torch.int32))
                assert torch.equal(ours["state" + suffix], theirs["state" + suffix])  # the codes are unchanged
                # Map entries <= MAP_ULP_TOLERANCE ulp apart (relative 2**-23 each at most), and each product
                # rounded (2**-24 relative): so relative (MAP_ULP_TOLERANCE * 2**-23 + 2 * 2**-24) at most, to first
                # order (1 + 2**-20 covers the products of those small terms).
                a, b = _decoded(ours, suffix), _decoded(theirs, suffix)
                assert bool(((a - b).abs() <= (MAP_ULP_TOLERANCE * 2**-23 + 2**-23) * (1 + 2**-20) * b.abs()).all())
        for p, q in zip(after["hf_optim"]["params"], after["bnb"]["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
