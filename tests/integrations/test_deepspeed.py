"""DeepSpeed ZeRO-1, ZeRO-2, ZeRO-2 with optimizer offload and ZeRO-3 with hf_optim's 8-bit AdamW as the
Trainer's optimizer, run for real: 2 CPU processes (gloo, ``DS_ACCELERATOR=cpu``, as DeepSpeed's own CI runs its
unit tests), the configs shipped in recipes/accelerate/.

One torchrun runs everything (deepspeed_worker.py: each config as ``accelerate launch --config_file`` hands it to
its processes). Each config trains 4 steps with checkpoints at 2 and 4; a Trainer with other initial weights
resumes from checkpoint-2 and must end bit for bit where the uninterrupted run ended: losses, fp32 master
weights gathered from the partitions, and each rank's optimizer state. AdamW32bit under ZeRO-2 must train as it
does under DDP, bit for bit (an elementwise algorithm on partitions). The same processes check what hf_optim
refuses under ZeRO (one line, before the first step), the recipe CLI's printing under a launcher, and the line
that says an FSDP config did not apply on CPU processes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_optim
from hf_optim.integrations.deepspeed import needs_whole_tensors, precision_mismatch, zero_problems
from hf_optim.integrations.names import OPTIMIZER_NAMES
from hf_optim.optim.base import PARAM_OVERRIDES_ATTR

pytestmark = pytest.mark.slow  # one torchrun of 2 processes (DeepSpeed, the Trainer): about a minute

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
RANKS = (0, 1)
ZERO_RUNS = {  # result key -> the ZeRO optimizer DeepSpeed wraps hf_optim's in
    "zero1": "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    "zero2": "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    "zero2_offload": "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    "zero3": "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Each rank's results (index = rank)."""
    # in the test extra: a missing install fails here, with its name (found, not imported: that takes seconds)
    assert importlib.util.find_spec("deepspeed") is not None, "deepspeed is not installed: pip install -e '.[test]'"

    tmp = tmp_path_factory.mktemp("deepspeed")
    out = tmp / "results.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_OPTIM_COMPILE": "0",
           "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("RANK", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(TESTS / "deepspeed_worker.py"), str(out), str(tmp)]
    # from the repository root, as the configs' relative paths (the offload JSON) are meant to be launched
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    results = torch.load(out, weights_only=False)
    print("deepspeed_worker seconds (rank 0):", {k: round(v, 1) for k, v in results[0]["seconds"].items()})
    return results


@pytest.mark.parametrize("config", ZERO_RUNS)
def test_zero_trains_saves_and_resumes_bit_for_bit(results, config):
    for rank in RANKS:
        run = results[rank][config]
        assert run["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
        assert len(run["losses"]) == 4 and run["resumed_losses"] == run["losses"], (rank, run)
        for name, expected in run["weights"].items():
            assert torch.equal(run["resumed_weights"][name], expected), (rank, name)
        state, resumed = run["stepped"]["state"], run["resumed_stepped"]["state"]
        assert state.keys() == resumed.keys() and state
        for key, expected in state.items():
            assert torch.equal(resumed[key], expected), (rank, key)


@pytest.mark.parametrize("config", ZERO_RUNS)
def test_zero_hands_hf_optim_a_partition_of_each_param_group(results, config):
    """hf_optim's AdamW8bit steps under DeepSpeed's ZeRO optimizer (not replaced, also under offload), on one
    flat 1-D partition per param group (the Trainer's decay and no-decay groups) that holds this rank's part:
    the two ranks' partitions together are the model's parameters. 8-bit state follows the partition's size:
    uint8 codes for the large partition, fp32 for the one under min_8bit_size (4096) elements."""
    sizes = []
    for rank in RANKS:
        run = results[rank][config]
        assert run["chain"] == ["accelerate.utils.deepspeed.DeepSpeedOptimizerWrapper", ZERO_RUNS[config],
                                "hf_optim.optim.adamw.AdamW8bit"]
        stepped = run["stepped"]
        assert stepped["class"] == "AdamW8bit"
        assert all(len(shape) == 1 for shape in stepped["shapes"]) and len(stepped["shapes"]) == 2
        sizes.append(sum(shape[0] for shape in stepped["shapes"]))
        for index, (size,) in enumerate(stepped["shapes"]):
            expected = torch.uint8 if size >= 4096 else torch.float32
            assert stepped["state"][f"{index}.state1"].dtype == expected, (rank, index, size)
    total = results[0][config]["model_parameters"]
    assert sizes[0] < total and sum(sizes) == total  # partitioned (no padding needed for this model)


def test_zero_steps_elementwise_algorithms_as_ddp_steps_the_tensors(results):
    """AdamW32bit (hf_optim's) under ZeRO-2 with offload equals the same Trainer under DDP bit for bit, 4 steps
    from the same weights and data: with 2 ranks the averaged gradients are the same numbers, so an elementwise
    update of the flat partitions is the update of the tensors (and hf_optim's decoupled weight decay is kept: a
    swap to DeepSpeed's CPU Adam would make it L2)."""
    for rank in RANKS:
        runs = results[rank]["same_math"]
        assert runs["zero2_offload"]["chain"][-1] == runs["ddp"]["chain"][-1] == "hf_optim.optim.adamw.AdamW32bit"
        assert runs["ddp"]["chain"][0] == "accelerate.optimizer.AcceleratedOptimizer"  # no DeepSpeed there
        ddp, zero = runs["ddp"]["weights"], runs["zero2_offload"]["weights"]
        assert ddp.keys() == zero.keys() == runs["initial"].keys()
        assert all(not torch.equal(ddp[name], runs["initial"][name]) for name in ddp)  # every tensor trained
        for name, expected in ddp.items():
            assert torch.equal(zero[name], expected), (rank, name, (zero[name] - expected).abs().max().item())


@pytest.mark.parametrize("name", ["lamb_8bit", "adafactor", "muon_8bit", "adamw_4bit_rank1"])
def test_optimizers_that_need_whole_tensors_are_refused_before_the_first_step(results, name):
    label = OPTIMIZER_NAMES[name].class_label
    for rank in RANKS:
        refused = results[rank]["refused"][name]
        assert refused["steps"] == 0 and refused["type"] == "DeepSpeedConflict", refused
        message = refused["error"]
        assert "\n" not in message and message.startswith(f"{label} cannot run under DeepSpeed ZeRO-2")
        assert "FSDP2" in message and "fsdp2.yaml" in message


def test_offload_that_would_replace_hf_optim_is_refused_before_the_first_step(results):
    """accelerate would build DeepSpeed's CPU Adam in its place (and compile it): refused before that."""
    for rank in RANKS:
        refused = results[rank]["refused"]["offload_replaced"]
        assert refused["steps"] == 0 and refused["type"] == "DeepSpeedConflict", refused
        assert "\n" not in refused["error"] and '"zero_force_ds_cpu_optimizer": false' in refused["error"]
        assert refused["error"].startswith("hf_optim.AdamW8bit would be replaced by DeepSpeed's CPU Adam")


def test_no_deepspeed_op_is_built(results):
    """Neither the shared-memory collective op (gloo does the collectives) nor CPU Adam (hf_optim steps)."""
    assert [results[rank]["built_ops"] for rank in RANKS] == [[], []]


def test_cli_under_deepspeed_names_hf_optim_and_prints_its_summary_once(results):
    """`accelerate launch --config_file recipes/accelerate/deepspeed_zero2_offload.yaml -m hf_optim.cli train`:
    the summary lines come from rank 0 only, and they, summary.json and the plots' label name the class that
    stepped (PagedAdamW8bit), not accelerate's or DeepSpeed's wrapper."""
    from hf_optim.monitor.runfiles import RunData

    first, other = (results[rank]["cli"]["train"] for rank in RANKS)
    assert first["status"] == other["status"] == 0
    assert first["stdout"].count("done: optimizer hf_optim.PagedAdamW8bit,") == 1
    assert first["stdout"].count("run directory:") == 1
    assert other["stdout"] == ""
    assert "optim='paged_adamw_8bit'" in first["stderr"] and "optim=" not in other["stderr"]  # INFO: rank 0
    summary = results[0]["cli"]["summary"]
    assert summary["optimizer"]["name"] == "PagedAdamW8bit"
    assert RunData(Path("run"), summary=summary).optimizer_label == "PagedAdamW8bit"  # the plots' title label


@pytest.mark.parametrize("case,says", [("lamb", "training.optim: hf_optim.LAMB8bit cannot run under DeepSpeed ZeRO-2"),
                                       ("bf16", "training.bf16: the DeepSpeed config turns bf16 on")])
def test_cli_refusal_under_deepspeed_is_one_error_line_from_rank_0(results, case, says):
    """Refused in the recipe's checks, before the model is built: one `error:` line (transformers' own bf16
    mismatch error would come at the first step, over several lines)."""
    first, other = (results[rank]["cli"][case] for rank in RANKS)
    assert first["status"] == other["status"] == 2
    lines = first["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
    assert other["stderr"] == "" and first["stdout"] == other["stdout"] == ""


def test_fsdp_config_on_cpu_processes_says_it_did_not_apply(results):
    """accelerate turns a FSDP config into FSDP only for GPU processes: on CPU it trains under DDP. One line
    (rank 0) says so; the run goes on."""
    first, other = (results[rank]["cli"]["fsdp"] for rank in RANKS)
    assert first["status"] == other["status"] == 0
    said = [line for line in first["stderr"].splitlines() if "FSDP was asked for" in line]
    assert len(said) == 1 and "did not take effect" in said[0] and "each of the 2 processes" in said[0]
    assert "FSDP was asked for" not in other["stderr"]


# ---------------------------------------------------------------------------------------------------------------
# In-process: which optimizers need whole tensors, and per-parameter settings against ZeRO's parameter swap
def test_exactly_lamb_adafactor_muon_and_rank1_state_need_whole_tensors():
    needing = {name for name, entry in OPTIMIZER_NAMES.items()
               if needs_whole_tensors(entry.algorithm, entry.state_format)}
    expected = {name for name, entry in OPTIMIZER_NAMES.items()
                if entry.family in ("lamb", "adafactor", "muon") or name.endswith("_rank1")}
    assert needing == expected and "adamw_8bit" not in needing and "lion_4bit" not in needing


def test_zero_problems_follow_the_stage_and_the_offload_setting():
    lamb, adamw = OPTIMIZER_NAMES["lamb_8bit"], OPTIMIZER_NAMES["adamw_8bit"]
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert zero_problems("x", lamb.algorithm, lamb.state_format, {"zero_optimization": {"stage": 0}}) == []
    assert zero_problems("x", adamw.algorithm, adamw.state_format, {"zero_optimization": {"stage": 3}}) == []
    assert len(zero_problems("x", lamb.algorithm, lamb.state_format, {"zero_optimization": {"stage": 1}})) == 1
    assert len(zero_problems("x", adamw.algorithm, adamw.state_format, offload)) == 1
    assert zero_problems("x", adamw.algorithm, adamw.state_format, {**offload, "zero_force_ds_cpu_optimizer": False}) \
        == []


def test_precision_mismatch_is_found_where_the_trainer_would_refuse_it():
    class Args:
        bf16, fp16 = False, False

    assert precision_mismatch({"bf16": {"enabled": True}}, Args())[0] == "bf16"
    assert precision_mismatch({"fp16": {"enabled": True}}, Args())[0] == "fp16"
    assert precision_mismatch({"bf16": {"enabled": "auto"}}, Args()) is None
    Args.bf16 = True
    assert precision_mismatch({"bf16": {"enabled": True}}, Args()) is None


def test_a_partition_in_a_parameters_place_does_not_take_its_overrides():
    """ZeRO puts one flat partition where a group's first parameter was. The embedding's 32-bit override recorded
    there must not make the whole partition's state fp32 (it did: every tensor of the partition stepped 32-bit)."""
    embedding, weight = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 128))
    setattr(embedding, PARAM_OVERRIDES_ATTR, {"optim_bits": 32})
    optimizer = hf_optim.AdamW8bit([embedding, weight])
    partition = torch.zeros(64 * 64 + 64 * 128, requires_grad=True)
    optimizer.param_groups[0]["params"] = [partition]
    partition.grad = torch.randn_like(partition)
    optimizer.step()
    assert optimizer.state[partition]["state1"].dtype == torch.uint8
