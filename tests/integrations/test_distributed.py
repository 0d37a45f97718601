"""DDP and FSDP2 with CPU processes (gloo, launched by torchrun): every algorithm and state format against a
single-process run, and torch.distributed.checkpoint (DCP) checkpoints that move between world sizes.

One torchrun per world size runs every case of that world size (distributed_worker.py): 4 ranks, then 2, then 3 (each
loads the checkpoint an earlier one wrote, ``distributed_worker.LOADS``); each test here checks one part of their
results. What is exact and what is not:
- DDP: every run equals the single-process run bit for bit (each rank steps the whole, identical tensor).
- FSDP2, elementwise algorithms (AdamW, AdEMAMix, Lion, RMSprop, and Muon's momentum and AdamW rule) in every format:
  bit-exact at 2, 3 and 4 ranks, on uneven shards whose boundaries split blocks, packed bytes and rank-1 rows: a
  rank's blocks are the whole tensor's (hf_optim/optim/sharded_blocks.py).
- FSDP2, LAMB and Adafactor: their norms, column statistics and RMS values are sums all-reduced across the shard
  group, equal to the unsharded ones up to float summation order (~1e-8 here); with quantized state a last-digit
  difference can move a code by one step, so those agree to within the quantized run's distance from 32-bit.
- A DCP checkpoint saved at N ranks and loaded at M (1, 2, 3, 4, HSDP) resumes as the M-rank (= single-process) run,
  with the same tolerances.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import elastic_cases as elastic
import pytest
import torch
from distributed_cases import OPTIMIZERS, ROW_WISE, Net, build_optimizer, single_process_run
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import hf_optim

pytestmark = pytest.mark.slow  # subprocesses / Trainer runs: several seconds each

TESTS = Path(__file__).resolve().parents[1]
EXACTNESS_OF_SUMS = 1e-6  # LAMB / Adafactor: float sums in another order (observed ~3e-8)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("distributed")


def torchrun(world_size: int, workspace: Path) -> dict:
    out = workspace / f"results-{world_size}.pt"
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "OMP_NUM_THREADS": "1", "HF_OPTIM_COMPILE": "0"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size),
               str(TESTS / "distributed_worker.py"), str(out), str(workspace / "checkpoints")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=TESTS)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def single(workspace):
    """One process (one thread, as each torchrun worker): every world-size case trained straight, the reference;
    and the 1-process DCP checkpoint after SAVE_AT steps, which the 4-rank run loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with one_thread():
        saved, references = {}, {}
        for name in [*elastic.CONFIGS, *elastic.REFERENCE_ONLY]:
            module, optimizer = elastic.single_process(name, range(elastic.SAVE_AT))
            if name in elastic.FEW:
                model_state, optim_state = get_state_dict(module, optimizer)
                saved[name] = {"model": model_state, "optim": optim_state}
            references[name] = {"module": module, "optimizer": optimizer}
        dcp.save(saved, checkpoint_id=workspace / "checkpoints" / "elastic-1")
        for built in references.values():
            elastic.train(built["module"], built["optimizer"], range(elastic.SAVE_AT, elastic.STEPS))
        return {name: {"params": elastic.whole_params(built["module"]),
                       "dtypes": state_dtypes(built["module"], built["optimizer"])}
                for name, built in references.items()}


@pytest.fixture(scope="module")
def world4(single, workspace):
    return torchrun(4, workspace)


@pytest.fixture(scope="module")
def results(world4, workspace):
    """The 2-rank run: every case of the original 2-process tests, and the world-size cases."""
    return torchrun(2, workspace)


@pytest.fixture(scope="module")
def world3(results, workspace):
    return torchrun(3, workspace)


@pytest.fixture(scope="module")
def single_resumed(results, workspace):
    """One process loads the 2-rank DCP checkpoint into plain (unsharded) models and trains on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with one_thread():
        built, templates = {}, {}
        for name in elastic.CONFIGS:
            module = elastic.model()
            optimizer = elastic.build(name, module)
            model_state, optim_state = get_state_dict(module, optimizer)
            templates[name] = {"model": model_state, "optim": optim_state}
            built[name] = (module, optimizer)
        dcp.load(templates, checkpoint_id=workspace / "checkpoints" / "elastic-2")
        resumed = {}
        for name, (module, optimizer) in built.items():
            set_state_dict(module, optimizer, model_state_dict=templates[name]["model"],
                           optim_state_dict=templates[name]["optim"])
            steps = sorted({s["step"] for s in optimizer.state.values()})
            elastic.train(module, optimizer, range(elastic.SAVE_AT, elastic.STEPS))
            resumed[name] = {"params": elastic.whole_params(module), "loaded_steps": steps}
        return resumed


class one_thread:
    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


def state_dtypes(module, optimizer) -> dict[str, list[str]]:
    return {name: sorted({str(v.dtype) for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)})
            for name, p in module.named_parameters()}


@pytest.fixture(scope="module")
def references():
    """Single-process runs of every configuration of the 2-process forward/backward tests (one thread)."""
    with one_thread():
        return {name: single_process_run(name) for name in OPTIMIZERS}


QUANTIZED = ("8bit", "4bit")


def thirty_two_bit(name: str) -> str:
    return name.removesuffix("8bit").removesuffix("4bit") + "32bit"


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_ddp_matches_single_process_bit_for_bit(results, references, name):
    got = results["ddp"][name]["params"]
    for param, expected in references[name].items():
        assert torch.equal(got[param], expected), (param, max_diff(got[param], expected))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_matches_single_process(results, references, name):
    """Forward and backward under FSDP2 at 2 ranks (the gradient's mean over 2 ranks is exact): bit for bit,
    ``unaligned``'s 8-bit and 4-bit blocks included (split by the shard boundary, they are the whole tensor's)."""
    got = results["fsdp2"][name]["params"]
    row_wise = name.startswith(ROW_WISE)
    eight_bit = name.endswith(QUANTIZED)
    for param, expected in references[name].items():
        diff = max_diff(got[param], expected)
        if eight_bit and row_wise:
            # aligned blocks, but a last-digit difference in a norm can move an 8-bit code by one step
            noise = max_diff(references[thirty_two_bit(name)][param], expected)
            assert diff <= noise + EXACTNESS_OF_SUMS, (param, diff, noise)
        elif row_wise:
            assert diff <= EXACTNESS_OF_SUMS, (param, diff)
        else:
            assert diff == 0.0, (param, diff)


@pytest.mark.parametrize("scenario", ["ddp", "fsdp2"])
def test_8bit_state_follows_the_whole_parameter_size(results, scenario):
    """8-bit state for parameters of >= 4096 elements in total, even where a rank's shard is smaller (the
    unaligned tensor's shards have 2470 and 2340 elements); small parameters keep fp32 state."""
    big = {name for name, p in Net().named_parameters() if p.numel() >= 4096}
    assert big == {"aligned", "cube", "unaligned"}
    for name in OPTIMIZERS:
        for param, dtypes in results[scenario][name]["dtypes"].items():
            expect_8bit = name.endswith(QUANTIZED) and param in big
            assert ("torch.uint8" in dtypes) == expect_8bit, (name, param, dtypes)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_sharded_checkpoint_resumes_exactly(results, name):
    """get_state_dict + dcp.save after 2 steps; a fresh model (other weights) and optimizer load it with
    dcp.load + set_state_dict and train the last 3 steps: the same weights as the uninterrupted run."""
    run = results["resume"][name]
    assert run["loaded_steps"] == [2]
    assert run["loaded_dtypes"] == results["fsdp2"][name]["dtypes"]  # uint8 stays uint8, fp32 stays fp32
    for param, expected in run["straight"].items():
        assert torch.equal(run["resumed"][param], expected), (param, max_diff(run["resumed"][param], expected))


ACCELERATE_OPTIMIZERS = ["adamw_32bit", "adamw_8bit", "adamw_4bit", "lamb_8bit", "adafactor_8bit", "muon_8bit"]
"""distributed_worker.ACCELERATE_OPTIMIZERS: one per kind of state (every algorithm's DCP resume is tested above)."""
ACCELERATE_RUNS = [f"{name} {kind}" for kind in ["SHARDED_STATE_DICT use_dcp=True", "SHARDED_STATE_DICT use_dcp=False",
                                                 "FULL_STATE_DICT use_dcp=True"] for name in ACCELERATE_OPTIMIZERS]


@pytest.mark.parametrize("run", ACCELERATE_RUNS)
def test_fsdp2_optimizer_checkpoint_through_accelerate_resumes_exactly(results, run):
    """The Trainer's FSDP path (accelerate's save_fsdp_optimizer / load_fsdp_optimizer, FSDP2 plugin), in every
    format it writes. (The Trainer itself runs FSDP only on GPUs: accelerate has no FSDP for CPU processes.)"""
    got = results["accelerate"][run]
    for param, expected in got["straight"].items():
        assert torch.equal(got["resumed"][param], expected), (param, max_diff(got["resumed"][param], expected))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dict_api_state_creation_leaves_weights_alone(name):
    """get/set_optimizer_state_dict create missing state by a step with zero gradients and lr=0: no algorithm
    may move the weights then (Adafactor's relative step ignores lr, so lr=0 must mean no step)."""
    model = Net()
    optimizer = build_optimizer(name, model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    get_optimizer_state_dict(model, optimizer)
    assert len(optimizer.state) == len(before)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_adafactor_relative_step_with_lr_zero_takes_no_step():
    params = [torch.nn.Parameter(torch.randn(40, 30))]
    optimizer = hf_optim.Adafactor(params, weight_decay=0.1)
    optimizer.param_groups[0]["lr"] = 0.0
    before = params[0].detach().clone()
    params[0].grad = torch.randn(40, 30)
    optimizer.step()
    assert torch.equal(params[0], before)


@pytest.mark.parametrize("name", ["lamb_8bit", "adafactor_8bit"])
def test_trainer_under_torchrun_resumes_exactly(results, name):
    run = results["trainer_ddp"][name]
    assert run["parallel_mode"] == "ParallelMode.DISTRIBUTED" and run["world_size"] == 2
    assert run["optimizer"] == {"lamb_8bit": "LAMB8bit", "adafactor_8bit": "Adafactor"}[name]
    assert len(run["straight"]) == 4 and run["resumed"] == run["straight"]
    for param, expected in run["straight_params"].items():
        assert torch.equal(run["resumed_params"][param], expected), param


def test_embedding_32bit_override_survives_accelerates_fsdp2_parameter_swap():
    """Under FSDP2 the Trainer builds the optimizer before sharding; accelerate then swaps every parameter in
    param_groups for its sharded twin (fsdp2_switch_optimizer_parameters). The embedding's 32-bit override,
    an attribute of the old parameter, must still apply."""
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters

    from hf_optim.integrations.transformers import keep_embeddings_32bit
    from hf_optim.tiny import tiny_llama

    model = tiny_llama(layers=1)
    assert keep_embeddings_32bit(model) == 512 * 64  # elements marked
    optimizer = hf_optim.AdamW8bit(model.parameters())
    swapped = {p.data_ptr: torch.nn.Parameter(p.detach().clone()) for p in model.parameters()}
    fsdp2_switch_optimizer_parameters(optimizer, swapped)
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    optimizer.step()
    embedding = swapped[model.get_input_embeddings().weight.data_ptr]
    assert optimizer.state[embedding]["state1"].dtype == torch.float32
    big = [p for p in optimizer.param_groups[0]["params"] if p.numel() >= 4096 and p is not embedding]
    assert big and all(optimizer.state[p]["state1"].dtype == torch.uint8 for p in big)


def test_gradient_release_is_refused_on_several_ranks(results):
    """With DDP the post-accumulate-grad hooks fire before the all-reduce has averaged the gradient: stepping
    there would train each rank on its own gradient. The optimizer and the Trainer's arguments refuse it."""
    refused = results["release"]
    assert "2 ranks" in refused["optimizer"] and "all-reduce" in refused["optimizer"]
    assert len(refused["trainer"]) == 1 and "2 processes" in refused["trainer"][0]


# --------------------------------------------------------------------------------------------------------------
# Across world sizes (elastic_cases: given gradients, so that only the optimizer differs between world sizes)


def assert_like_single_process(got: dict, name: str, single: dict, where: str) -> None:
    """Bit for bit for every case but LAMB's and Adafactor's, which agree up to summation order (and, with quantized
    state, to within their quantized single-process run's distance from its 32-bit run: a last-digit difference
    can move one code)."""
    expected = single[name]["params"]
    algorithm, precision = name.split("_")
    for param, value in expected.items():
        diff = max_diff(got[param], value)
        if algorithm not in elastic.SUMMED:
            assert diff == 0.0, (where, param, diff)
        elif precision == "32bit":
            assert diff <= EXACTNESS_OF_SUMS, (where, param, diff)
        else:
            noise = max_diff(single[f"{algorithm}_32bit"]["params"][param], value)
            assert diff <= noise + EXACTNESS_OF_SUMS, (where, param, diff, noise)


WORLDS = {2: "results", 3: "world3", 4: "world4"}


@pytest.mark.parametrize("world_size", elastic.WORLD_SIZES)
@pytest.mark.parametrize("name", elastic.CONFIGS)
def test_fsdp2_state_does_not_depend_on_the_world_size(request, single, world_size, name):
    """Every algorithm and format under FSDP2 at 2, 3 and 4 ranks equals one process (see the module's tolerances),
    and keeps the same state dtypes (the whole tensor's size picks the format)."""
    run = request.getfixturevalue(WORLDS[world_size])["elastic"]
    assert_like_single_process(run["straight"][name], name, single, f"{world_size} ranks")
    assert run["dtypes"][name] == single[name]["dtypes"]


@pytest.mark.parametrize("world_size", elastic.WORLD_SIZES)
def test_collectives_run_only_for_blocks_a_shard_boundary_splits(request, world_size):
    """One optimizer step of AdamW (after the first) calls no collective where every shard boundary falls on a block
    boundary, and one all-reduce for the shard group where some tensors' blocks are split, however many: the scales
    of every split block travel together. Rank-1 4-bit's column scales span all rows, so each of its sharded
    matrices takes one all-reduce (distributed_worker.ALIGNED has two)."""
    counted = request.getfixturevalue(WORLDS[world_size])["collectives"]
    for name in ("adamw_8bit", "adamw_fp8", "adamw_4bit"):
        assert counted[f"aligned {name}"] == {"all_reduce": 0, "p2p": 0}, name
        assert counted[f"split {name}"] == {"all_reduce": 1, "p2p": 0}, name
    assert counted["aligned adamw_rank1"] == {"all_reduce": 2, "p2p": 0}


OTHER_RESUMES = (("1", "4"), ("4", "2"), ("2", "3"), ("2", "hsdp2x1"), ("1", "hsdp2x2"))
RESUMES = [("2", "1", name) for name in elastic.CONFIGS] + [
    (saved, loaded, name) for saved, loaded in OTHER_RESUMES for name in elastic.FEW]


@pytest.mark.parametrize("saved,loaded,name", RESUMES, ids=[f"{name}-{n}-to-{m}" for n, m, name in RESUMES])
def test_dcp_checkpoint_resumes_at_another_world_size(request, single, saved, loaded, name):
    """Trained SAVE_AT steps at N ranks and saved with DCP (get_state_dict + dcp.save); a model of other weights and a
    fresh optimizer at M ranks load it (dcp.load + set_state_dict) and train the remaining steps: the run that trained
    every step at M (one process's, by the test above). M = 1 is a plain optimizer without FSDP; "hsdp2xS" is 2
    replicas of S shards (2 or 4 ranks). Every case from 2 ranks to 1; one per format and the non-elementwise
    algorithms for the others (elastic_cases.FEW)."""
    if loaded == "1":
        run = request.getfixturevalue("single_resumed")[name]
    elif loaded.startswith("hsdp"):
        world = {"hsdp2x1": "results", "hsdp2x2": "world4"}[loaded]
        run = request.getfixturevalue(world)["elastic"][f"{loaded} from {saved}"][name]
    else:
        run = request.getfixturevalue(WORLDS[int(loaded)])["elastic"][f"from {saved}"][name]
    assert run["loaded_steps"] == [elastic.SAVE_AT]
    assert_like_single_process(run["params"], name, single, f"{saved} -> {loaded}")


ACCELERATE_ELASTIC = [f"{name} {kind}" for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
                      for name in ("adamw_8bit", "adamw_4bit")]


@pytest.mark.parametrize("run", ACCELERATE_ELASTIC)
def test_accelerate_fsdp_optimizer_checkpoint_moves_from_2_to_3_ranks(world3, single, run):
    """accelerate's save_fsdp_optimizer at 2 ranks, load_fsdp_optimizer at 3 (what the Trainer calls under FSDP)."""
    assert_like_single_process(world3["accelerate_elastic"][run], run.split()[0], single, run)


@pytest.fixture(scope="module")
def accelerate_one_rank(results, workspace):
    """load_fsdp_optimizer of the 2-rank checkpoints at 1 rank: FSDP2 over a one-process gloo group in this process
    (as the Trainer's FSDP run on one GPU shards over one rank)."""
    import torch.distributed as dist
    from accelerate import PartialState
    from distributed_worker import ACCELERATE_KINDS, ACCELERATE_NAMES, accelerate_resumed

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(workspace / "one-rank-store"), 1), rank=0, world_size=1)
    try:
        with one_thread():
            state = PartialState(cpu=True)
            return {f"{name} {kind}": accelerate_resumed(
                        kind, name, state, str(workspace / "checkpoints" / f"accelerate-elastic-{kind}" / name))
                    for kind in ACCELERATE_KINDS for name in ACCELERATE_NAMES}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("run", ACCELERATE_ELASTIC)
def test_accelerate_fsdp_optimizer_checkpoint_moves_from_2_ranks_to_1(accelerate_one_rank, single, run):
    """accelerate's save_fsdp_optimizer at 2 ranks, load_fsdp_optimizer at 1 (FSDP2 over one rank)."""
    assert_like_single_process(accelerate_one_rank[run], run.split()[0], single, run)


def index_keyed(full: dict) -> dict:
    """A gathered optimizer state dict (keyed by parameter names, as get_optimizer_state_dict gives it) keyed by
    parameter index, as ``optimizer.state_dict()`` is (what bitsandbytes' and hf_optim's load_state_dict read)."""
    names = list(elastic.SHAPES)
    groups = [{**group, "params": [names.index(param) for param in group["params"]]} for group in full["param_groups"]]
    return {"state": {names.index(param): state for param, state in full["state"].items()}, "param_groups": groups}


def test_gathered_8bit_state_of_fsdp2_is_the_single_process_bitsandbytes_state(world3):
    """The full state dict of AdamW8bit under FSDP2 at 3 ranks (uneven, block-splitting shards), gathered with
    get_optimizer_state_dict(full_state_dict=True), equals one process's state dict tensor for tensor, bit for bit;
    bitsandbytes' own AdamW8bit and hf_optim's load it and take the same next step."""
    import bitsandbytes as bnb

    gathered = index_keyed(world3["gathered_8bit"])
    module, optimizer = elastic.single_process("adamw_8bit", range(elastic.SAVE_AT))
    expected = optimizer.state_dict()
    assert gathered["state"].keys() == expected["state"].keys()
    quantized = 0
    for index, state in expected["state"].items():
        got = gathered["state"][index]
        flat_got = {**got, **got.get("__bnb_optimizer_quant_state__", {})}
        flat_expected = {**state, **state.get("__bnb_optimizer_quant_state__", {})}
        assert flat_got.keys() == flat_expected.keys()
        for key, value in flat_expected.items():
            if isinstance(value, torch.Tensor):
                assert flat_got[key].dtype == value.dtype and torch.equal(flat_got[key], value), (index, key)
        quantized += flat_expected["state1"].dtype == torch.uint8
    assert quantized == len(elastic.SHAPES) - 1  # all but the bias
    kwargs = dict(lr=1e-2, weight_decay=0.1, min_8bit_size=elastic.MIN_8BIT)
    ours_params = [torch.nn.Parameter(p.detach().clone()) for p in module.parameters()]
    theirs_params = [torch.nn.Parameter(p.detach().clone()) for p in module.parameters()]
    ours, theirs = hf_optim.AdamW8bit(ours_params, **kwargs), bnb.optim.AdamW8bit(theirs_params, **kwargs)
    ours.load_state_dict(gathered)
    theirs.load_state_dict(gathered)
    for p, q in zip(theirs_params, module.parameters()):
        state = theirs.state[p]
        assert state["step"] == elastic.SAVE_AT
        assert torch.equal(state["state1"], optimizer.state[q]["state1"])
    grads = elastic.gradients(elastic.SAVE_AT)
    for params in (ours_params, theirs_params):
        for p, name in zip(params, elastic.SHAPES):
            p.grad = grads[name].clone()
    ours.step(), theirs.step()
    for p, q in zip(ours_params, theirs_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)  # bitsandbytes' CPU encoder strays


def trainer_checkpoint(workspace: Path) -> Path:
    return workspace / "checkpoints" / f"trainer-{TRAINER_NAMES[0]}" / "out" / "checkpoint-2"


TRAINER_NAMES = ["lamb_8bit"]  # distributed_worker.TRAINER_NAMES[0]: the 2-rank Trainer run whose checkpoint resumes


def assert_resumed_from(run: dict, checkpoint: Path, world_size: int) -> None:
    """The resumed Trainer loaded the 2-rank checkpoint's 8-bit optimizer state exactly and trained on to step 4."""
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert run["world_size"] == world_size and run["optimizer"] == "LAMB8bit"
    assert run["loaded"]["state"].keys() == saved["state"].keys()
    codes = 0
    for index, state in saved["state"].items():
        flat = {**state, **state.get("__bnb_optimizer_quant_state__", {})}
        loaded = run["loaded"]["state"][index]
        loaded = {**loaded, **loaded.get("__bnb_optimizer_quant_state__", {})}
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), (index, key)
        codes += flat["state1"].dtype == torch.uint8
    assert codes > 0
    assert run["global_step"] == 4 and run["steps"] == [4]
    # the checkpoint's log (steps 1 and 2) and the resumed steps 3 and 4
    assert len(run["losses"]) == 4 and all(torch.isfinite(torch.tensor(run["losses"])))


def test_trainer_resumes_a_2_rank_checkpoint_on_3_ranks(world3, workspace):
    """The Trainer under torchrun (DDP, CPU) saved at 2 ranks; the same script resumes it with 3 processes. The data
    order and RNG state are not the 2-rank run's (docs/guide/distributed.md says what the Trainer does not carry)."""
    assert_resumed_from(world3["trainer_elastic"], trainer_checkpoint(workspace), 3)


def test_trainer_resumes_a_2_rank_checkpoint_in_one_process(results, workspace):
    from distributed_worker import loaded_state_callback
    from trainer_helpers import checkpointing_trainer, inner_optimizer, losses

    snapshot = loaded_state_callback()
    with one_thread():
        trainer = checkpointing_trainer(workspace / "trainer-elastic-1", TRAINER_NAMES[0], max_steps=4, save_steps=2,
                                        seed=1, callbacks=[snapshot])
        trainer.train(resume_from_checkpoint=str(trainer_checkpoint(workspace)))
    run = {"world_size": trainer.args.world_size, "optimizer": type(inner_optimizer(trainer)).__name__,
           "loaded": snapshot.state, "losses": losses(trainer), "global_step": trainer.state.global_step,
           "steps": sorted({s["step"] for s in inner_optimizer(trainer).state.values()})}
    assert_resumed_from(run, trainer_checkpoint(workspace), 1)


PER_SHARD_NAMES = ["adamw_8bit", "adamw_4bit"]  # distributed_worker.PER_SHARD_NAMES


def largest_gap(name: str, key: str) -> float:
    """The widest step between neighbouring values of the slot's map: re-quantizing a decoded value moves it by less
    than this times its block's absmax."""
    from hf_optim.formats.dynamic_map import dynamic_map
    from hf_optim.formats.quant4 import qmap4

    signed = key == "state1"
    qmap = dynamic_map(signed) if name.endswith("8bit") else qmap4(signed)
    return float((qmap[1:] - qmap[:-1]).max())


@pytest.mark.parametrize("name", PER_SHARD_NAMES)
def test_per_shard_checkpoint_loads_at_its_own_world_size(results, name):
    """An earlier hf_optim's per-shard 8-bit/4-bit checkpoint (per-rank sharded state dict, full state dict, and a DCP
    folder turned into a full state dict as docs/guide/distributed.md says) loads at the 2 ranks that saved it: tensors
    whose shards are whole blocks keep every value; the others, re-quantized from their shards' blocks to the whole
    tensor's, move by less than one step of the map."""
    run = results["per_shard"][name]
    for kind in ("sharded", "full", "dcp"):
        assert run[f"{kind} steps"] == [elastic.SAVE_AT]
        assert run[f"{kind} apart"] == ["odd", "thin", "unaligned"]
        for param, slots in run["saved"].items():
            for key, saved in slots.items():
                got = run[kind][param][key]
                if param not in run[f"{kind} apart"]:
                    assert torch.equal(got, saved), (kind, param, key)
                else:
                    # the worst case: a value near 0 of the unsigned 4-bit map (no zero) in the block holding the
                    # tensor's largest magnitude; (1 + 1e-6): the fp32 rounding of a decoded product
                    bound = largest_gap(name, key) * saved.abs().max() * (1 + 1e-6)
                    assert max_diff(got, saved) <= bound, (kind, param, key, max_diff(got, saved), bound)


@pytest.mark.parametrize("name", PER_SHARD_NAMES)
def test_per_shard_checkpoint_is_refused_at_another_world_size(world3, workspace, name):
    """At 3 ranks (set_optimizer_state_dict of the 2-rank full state dict) and in one process (load_state_dict): one
    line that says what to do."""
    message = world3["per_shard"][name]
    assert "\n" not in message and "per shard of 2 ranks" in message and "into 3 shards" in message
    assert "resume it on 2 ranks and save it again" in message
    full = index_keyed(torch.load(workspace / "checkpoints" / f"per-shard-{name}.pt", weights_only=False))
    module = elastic.model()
    optimizer = elastic.build(name, module)
    with pytest.raises(ValueError, match="per shard of 2 ranks") as refused:
        optimizer.load_state_dict(full)
    assert "\n" not in str(refused.value) and "into one process" in str(refused.value)
