"""torchrun worker for test_distributed.py: every algorithm under DDP and FSDP2, and sharded checkpoint resume.

Run as ``torchrun --nproc_per_node 2 tests/distributed_worker.py OUT_FILE CHECKPOINT_DIR`` (gloo, CPU). All
algorithms run inside this one pair of processes (starting processes is the slow part). Rank 0 writes the full
parameters of every run to OUT_FILE; the test compares them with single-process runs.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed_cases import OPTIMIZERS, RESUME_AT, Net, batches, build_optimizer, half, loss_fn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import hf_optim

warnings.filterwarnings("ignore")


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter as a whole tensor (FSDP2's DTensors gathered), on every rank."""
    module = getattr(model, "module", model)
    out = {}
    for name, p in module.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = p.detach().clone()
    return out


def train(model, optimizer, steps) -> None:
    rank = dist.get_rank()
    for batch in steps:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, *half(batch, rank)).backward()
        optimizer.step()


def state_dtypes(model, optimizer) -> dict[str, list[str]]:
    module = getattr(model, "module", model)
    return {
        name: sorted({str(v.dtype) for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)})
        for name, p in module.named_parameters()
    }


def data_parallel_runs(wrap) -> dict:
    results = {}
    for name in OPTIMIZERS:
        model = wrap(Net())
        optimizer = build_optimizer(name, model.parameters())
        train(model, optimizer, batches())
        results[name] = {"params": full_params(model), "dtypes": state_dtypes(model, optimizer)}
    return results


def fsdp2(model):
    fully_shard(model)
    return model


def trained_straight_through_a_checkpoint(name: str, path: str, data) -> torch.nn.Module:
    """An FSDP2 model trained on all of ``data``, saved with torch.distributed.checkpoint at ``RESUME_AT`` steps."""
    model = fsdp2(Net())
    optimizer = build_optimizer(name, model.parameters())
    train(model, optimizer, data[:RESUME_AT])
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    train(model, optimizer, data[RESUME_AT:])
    return model


def checkpoint_resume_runs(checkpoint_dir: str) -> dict:
    """FSDP2: save model and optimizer with torch.distributed.checkpoint after RESUME_AT steps, train on; then a
    fresh model and optimizer (from another initialization) load the checkpoint and train the same steps."""
    data = batches()
    results = {}
    for name in OPTIMIZERS:
        path = f"{checkpoint_dir}/{name}"
        model = trained_straight_through_a_checkpoint(name, path, data)

        other = Net()
        with torch.no_grad():
            for p in other.parameters():
                p.add_(1.0)  # the checkpoint, not the initialization, must decide where training resumes
        resumed = fsdp2(other)
        resumed_optimizer = build_optimizer(name, resumed.parameters())
        model_state, optim_state = get_state_dict(resumed, resumed_optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded_steps = sorted({s["step"] for s in resumed_optimizer.state.values()})
        loaded_dtypes = state_dtypes(resumed, resumed_optimizer)
        train(resumed, resumed_optimizer, data[RESUME_AT:])
        results[name] = {
            "straight": full_params(model),
            "resumed": full_params(resumed),
            "loaded_steps": loaded_steps,
            "loaded_dtypes": loaded_dtypes,
        }
    return results


def accelerate_resume_runs(checkpoint_dir: str) -> dict:
    """The functions the Trainer calls under FSDP to save and load the optimizer (accelerate's
    save_fsdp_optimizer / load_fsdp_optimizer with an FSDP2 plugin), in each of their formats: sharded through
    torch.distributed.checkpoint, sharded as per-rank torch.save files, and a full state dict. A twin trained
    the same first steps loads the optimizer into a fresh instance and trains on."""
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import load_fsdp_optimizer, save_fsdp_optimizer

    state = PartialState(cpu=True)  # the process index and barrier accelerate's functions use
    data = batches()
    results = {}
    for state_dict_type, use_dcp in [("SHARDED_STATE_DICT", True), ("SHARDED_STATE_DICT", False),
                                     ("FULL_STATE_DICT", True)]:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)
        for name in OPTIMIZERS:
            path = f"{checkpoint_dir}/accelerate-{state_dict_type}-{use_dcp}/{name}"
            model = fsdp2(Net())
            optimizer = build_optimizer(name, model.parameters())
            train(model, optimizer, data[:RESUME_AT])
            save_fsdp_optimizer(plugin, state, optimizer, model, path, use_dcp=use_dcp)
            train(model, optimizer, data[RESUME_AT:])

            twin = fsdp2(Net())
            train(twin, build_optimizer(name, twin.parameters()), data[:RESUME_AT])
            twin.zero_grad(set_to_none=True)  # as after the Trainer's model load: no gradients yet
            resumed_optimizer = build_optimizer(name, twin.parameters())
            load_fsdp_optimizer(plugin, state, resumed_optimizer, twin, path, use_dcp=use_dcp)
            train(twin, resumed_optimizer, data[RESUME_AT:])
            results[f"{name} {state_dict_type} use_dcp={use_dcp}"] = {
                "straight": full_params(model), "resumed": full_params(twin)
            }
    return results


RESHARD_NAMES = ["adamw_32bit", "lamb_32bit", "adafactor_32bit", "muon_32bit", "adamw_8bit", "adamw_4bit",
                 "adafactor_8bit", "muon_8bit"]


def reshard_runs(checkpoint_dir: str) -> dict:
    """Load an FSDP2 checkpoint (2 shards) into another layout: HSDP over a (2, 1) mesh, every parameter
    replicated twice and "sharded" once. 32-bit state reshards; 8-bit state, whose absmax counts the blocks of the
    saved shards, must be refused."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh

    data = batches()
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    results = {}
    for name in RESHARD_NAMES:
        path = f"{checkpoint_dir}/reshard-{name}"
        model = trained_straight_through_a_checkpoint(name, path, data)

        other = Net()
        fully_shard(other, mesh=mesh)
        other_optimizer = build_optimizer(name, other.parameters())
        model_state, optim_state = get_state_dict(other, other_optimizer)
        state = {"model": model_state, "optim": optim_state}
        try:
            dcp.load(state, checkpoint_id=path)
        except CheckpointException as error:
            results[name] = {"error": str(error)}
            continue
        set_state_dict(other, other_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train(other, other_optimizer, data[RESUME_AT:])
        results[name] = {"straight": full_params(model), "resumed": full_params(other)}
    return results


TRAINER_NAMES = ["lamb_8bit", "adafactor_8bit"]


def trainer_ddp_resume_runs(checkpoint_dir: str) -> dict:
    """The Trainer under torchrun (DDP on CPU processes): a run resumed from its step-2 checkpoint logs the same
    losses as the uninterrupted run (rank 0 wrote optimizer.pt; every rank loads it)."""
    from pathlib import Path

    from trainer_helpers import checkpointing_trainer, inner_optimizer, losses

    results = {}
    for name in TRAINER_NAMES:
        root = Path(checkpoint_dir) / f"trainer-{name}"
        straight = checkpointing_trainer(root, name, max_steps=4, save_steps=2)
        straight.train()
        resumed = checkpointing_trainer(root, name, max_steps=4, save_steps=2, seed=1)
        resumed.train(resume_from_checkpoint=str(root / "out" / "checkpoint-2"))
        results[name] = {
            "parallel_mode": str(straight.args.parallel_mode), "world_size": straight.args.world_size,
            "optimizer": type(inner_optimizer(straight)).__name__,
            "straight": losses(straight), "resumed": losses(resumed),
            "straight_params": full_params(straight.model), "resumed_params": full_params(resumed.model),
        }
    return results


def release_refusals(checkpoint_dir: str) -> dict:
    """Gradient release on 2 ranks: the optimizer refuses it (its hooks would step before DDP's all-reduce), and
    the Trainer's arguments name the distributed setup as the reason."""
    from transformers import TrainingArguments

    from hf_optim.integrations.transformers import release_argument_problems

    results = {}
    try:
        hf_optim.AdamW8bit(DistributedDataParallel(Net()).parameters(), release_gradients=True)
    except ValueError as error:
        results["optimizer"] = str(error)
    args = TrainingArguments(output_dir=f"{checkpoint_dir}/release", use_cpu=True, max_grad_norm=0, report_to=[],
                             optim="adamw_8bit", optim_args="release_gradients=True")
    results["trainer"] = release_argument_problems(args)
    return results


def main(out_file: str, checkpoint_dir: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {
        "ddp": data_parallel_runs(DistributedDataParallel),
        "fsdp2": data_parallel_runs(fsdp2),
        "resume": checkpoint_resume_runs(checkpoint_dir),
        "accelerate": accelerate_resume_runs(checkpoint_dir),
        "reshard": reshard_runs(checkpoint_dir),
        "trainer_ddp": trainer_ddp_resume_runs(checkpoint_dir),
        "release": release_refusals(checkpoint_dir),
    }
    if dist.get_rank() == 0:
        torch.save(results, out_file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
