"""Every Triton kernel configuration the optimizers launch compiles ahead of time for an H100 (sm_90) and a T4
(sm_75) with no spills and no local memory, without a GPU (``python -m hf_optim.gpu_static``; the other arches and
the timings are the tool's); and the kernels' machine code keeps the properties the bit-compatibility claims rest
on (tests/triton_compile_check.py). Not a timing: compile seconds are printed, never asserted.

Compilation runs in a fresh process without TRITON_INTERPRET (conftest sets it on machines without a GPU, and
kernels defined under the interpreter cannot be compiled), into one Triton cache per module (``aot_cache``): the
table fills it, and the sm_90 compile check then reads its binaries from there instead of compiling the same kernels
again (Triton's cache key covers the source, signature, constants, options and target, so a hit is the binary that
compilation would give). Both live in this one module so that they share the cache however the suite is split
across processes (pytest-xdist sends a whole module to one worker).
tests/gpu_static_probe.py compiles kernels with known answers: one that must spill (so the check can fail), one with a
run-time branch and one with a run-time loop (so the main-path analysis picks the right arm and counts trips).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton (a test dependency) is not installed: its compiler and ptxas are needed")

ROOT = Path(__file__).resolve().parents[2]
ARCHES = ("sm_90", "sm_75")


def _run(args: list[str], tmp: Path, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(cache or tmp / "triton_cache")
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)


@pytest.fixture(scope="module")
def aot_cache(tmp_path_factory) -> Path:
    """This module's Triton cache. Never the user's (~/.triton/cache): its key hashes the kernel's own source, not
    the whole file, so after an edit elsewhere in a kernel's file a cached PTX's line numbers point at other lines,
    and the contraction check (which reads the source line of every fma) fails on a kernel that is fine."""
    return tmp_path_factory.mktemp("triton_aot_cache")


@pytest.fixture(scope="module")
def table(tmp_path_factory, aot_cache) -> dict:
    tmp = tmp_path_factory.mktemp("gpu_static")
    out = tmp / "table.json"
    # hf_optim.gpu_static compiles cold whatever the cache holds (Triton's always_compile) and writes every binary to it
    cache = aot_cache
    # the cores this worker may take: all of them in a serial run, its share when pytest-xdist runs workers beside it
    jobs = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    done = _run(["-m", "hf_optim.gpu_static", "--arch", ",".join(ARCHES), "--jobs", str(jobs), "--json", str(out)],
                tmp, cache)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("gpu_static_probe")
    done = _run(["tests/gpu_static_probe.py", str(tmp / "probe.json")], tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp / "probe.json").read_text())


@pytest.mark.slow  # about 2-3 minutes of compilation on 2 idle cores
def test_every_configuration_compiles_for_sm90_and_sm75(table):
    rows = {(row["config"], row["arch"]): row for row in table["rows"]}
    assert set(table["arches"]) == set(ARCHES)
    missing = [(name, arch) for name in table["configs"] for arch in ARCHES if (name, arch) not in rows]
    assert not missing
    failed = [f"{name} on {arch}: {row['error']}" for (name, arch), row in rows.items() if "error" in row]
    assert not failed, failed
    # the enumeration covers every algorithm with a Triton path, each in every state format it supports
    names = set(table["configs"])
    for family in ("adamw", "ademamix", "lion", "rmsprop"):
        for bits in (32, 8, 4):
            for tile in ("full", "partial", "full sr", "partial sr"):
                assert f"fused/{family} bf16 {bits}bit {tile}" in names
    assert any(name.startswith("lamb/direction") for name in names)
    assert any(name.startswith("adafactor/apply") for name in names)


def import_gpu_static():
    """``hf_optim.gpu_static``, imported in this process. It turns the interpreter off for the kernels it defines;
    Triton kernels that later tests in this process define (test_custom_algorithm's) must still run in it."""
    interpret = os.environ.get("TRITON_INTERPRET")
    try:
        import hf_optim.gpu_static  # noqa: PLC0415
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    return hf_optim.gpu_static


@pytest.mark.slow
def test_no_configuration_spills_or_uses_local_memory(table):
    """Issue 22's target: no spills on any arch, for every configuration (no known exceptions)."""
    assert import_gpu_static().problems(table["rows"]) == []


def test_the_predicted_set_is_the_llama_3_2_1b_full_fine_tune():
    """The prediction's tensors, against the recipes' bundled Llama-3.2-1B config (tied embeddings)."""
    from hf_optim.recipes.estimate import KNOWN_ARCHITECTURES  # noqa: PLC0415

    cfg = KNOWN_ARCHITECTURES["llama-3.2-1b"]
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * hidden // cfg["num_attention_heads"]
    numels = import_gpu_static().llama_numels()
    assert len(numels) == 2 + 9 * layers
    assert sum(numels) == (cfg["vocab_size"] * hidden + hidden
                           + layers * (2 * hidden * hidden + 2 * kv * hidden + 3 * cfg["intermediate_size"] * hidden
                                       + 2 * hidden))


@pytest.mark.slow
def test_fused_kernels_keep_registers_and_occupancy(table):
    """Issue 22's targets for the fused elementwise kernels (AdamW, AdEMAMix, Lion, RMSprop, LAMB's passes), whole
    and partial tiles: at most 96 registers per thread and at least 50% occupancy at the launch's warps."""
    fused = [row for row in table["rows"] if row["group"] in ("fused", "lamb")]
    assert fused
    low = [f"{row['config']} on {row['arch']}: {row['regs']} registers, {row['occupancy']:.0%} occupancy"
           for row in fused if row["regs"] > 96 or row["occupancy"] < 0.5]
    assert low == []


@pytest.mark.slow
def test_every_main_path_is_found(table):
    assert [row["config"] for row in table["rows"] if "analysis_error" in row] == []


@pytest.mark.slow
def test_main_path_counts_of_the_fused_kernels_are_decided(table):
    """Every fused elementwise row has a per-element count, no branch left undecided, and a bandwidth-bound
    prediction whose bytes follow the state format (4-bit < 8-bit < 32-bit)."""
    fused = [row for row in table["rows"] if row["group"] in ("fused", "lamb") and row["elements_per_program"]]
    assert fused
    for row in fused:
        assert row["instructions_per_element"] > 0 and row["ambiguous_branches"] == 0, row["config"]
    h100 = {row["config"]: row for row in table["rows"] if row["arch"] == "sm_90" and "H100_bandwidth_ms" in row}
    bandwidth = [h100[f"fused/adamw bf16 {bits}bit full"]["H100_bandwidth_ms"] for bits in (4, 8, 32)]
    assert bandwidth == sorted(bandwidth) and len(set(bandwidth)) == 3
    assert not any("partial" in name for name in h100)  # predictions are for the main path only


@pytest.mark.slow
def test_the_spill_check_fails_on_a_kernel_that_spills(probe):
    assert probe["spills"]["spill_stores"] > 0 and probe["spills"]["spill_loads"] > 0
    assert probe["spills"]["local_instructions"] > 0
    assert any("spills" in line for line in probe["spill_problems"])


@pytest.mark.slow
def test_main_path_takes_the_configured_arm_of_a_runtime_branch(probe):
    assert probe["branch binary"]["rsq"] > 0 and probe["branch binary"]["ex2"] > 0  # both arms are in the binary
    assert probe["branch flag=0"] == {"rsq": probe["branch binary"]["rsq"], "ex2": 0, "ambiguous": 0}
    assert probe["branch flag=1"] == {"rsq": 0, "ex2": probe["branch binary"]["ex2"], "ambiguous": 0}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "sm_75"])
def test_main_path_counts_loop_trips(probe, arch):
    one, two, eight = (probe[f"loop {arch} trips={t}"] for t in (1, 2, 8))
    body = two["instructions"] - one["instructions"]
    assert body > 0
    assert eight["instructions"] - two["instructions"] == 6 * body
    assert eight["loads"] == one["loads"] + 7 * (two["loads"] - one["loads"]) > one["loads"]
    assert one["ambiguous"] == two["ambiguous"] == eight["ambiguous"] == 0


@pytest.mark.slow  # ~30 s of compilation on 2 cores when the table has not filled the cache
def test_every_kernel_compiles_for_sm90_with_ieee_math_and_vector_accesses(tmp_path, aot_cache):
    """tests/triton_compile_check.py: IEEE division and square root, no contracted multiply-adds, vector accesses on
    whole tiles and no spills, for every kernel the optimizers launch (the CPU interpreter accepts code the GPU
    compiler rejects: this is the only check of the GPU code path without a GPU)."""
    done = _run([str(Path(__file__).resolve().parents[1] / "triton_compile_check.py")], tmp_path, aot_cache)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all kernels compiled" in done.stdout
