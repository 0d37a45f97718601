"""torchrun worker for test_distributed.py: every algorithm under DDP and FSDP2, sharded checkpoint resume, and
optimizer state and checkpoints across world sizes.

Run as ``torchrun --nproc_per_node W tests/distributed_worker.py OUT_FILE CHECKPOINT_DIR`` (gloo, CPU), once per world
size W (2, 3, 4): every case of a world size runs inside its one set of processes (starting processes is the slow
part). At 2 ranks: DDP and FSDP2 against one process, checkpoints, accelerate's FSDP functions, the Trainer under
torchrun; at every world size the world-size cases of ``elastic_cases``, loading the DCP checkpoint another world size
wrote (the test launches 4, then 2, then 3: see :data:`LOADS`). Rank 0 writes the full parameters of every run to
OUT_FILE; the test compares them with single-process runs.
"""

from __future__ import annotations

import sys
import warnings

import elastic_cases as elastic
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed_cases import OPTIMIZERS, RESUME_AT, Net, batches, build_optimizer, half, loss_fn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.nn.parallel import DistributedDataParallel

import hf_optim
from hf_optim.optim import sharding

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


ACCELERATE_OPTIMIZERS = ["adamw_32bit", "adamw_8bit", "adamw_4bit", "lamb_8bit", "adafactor_8bit", "muon_8bit"]
"""The optimizers through accelerate's functions: one per kind of state (fp32, 8-bit, packed 4-bit slots; LAMB's;
Adafactor's statistics; Muon's two rules). The functions pass get/set_optimizer_state_dict's dicts through unchanged,
and every algorithm's DCP checkpoint resumes in checkpoint_resume_runs."""


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
        for name in ACCELERATE_OPTIMIZERS:
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


# --------------------------------------------------------------------------------------------------------------
# Across world sizes (elastic_cases)

LOADS = {4: 1, 2: 4, 3: 2}
"""The world size whose checkpoint each world size loads (1: the test process's single-process checkpoint)."""
SAVES = {4: elastic.FEW, 2: tuple(elastic.CONFIGS), 3: ()}
"""The cases each world size saves for a later one (2 -> 1, in the test process, takes every case)."""
HSDP = {2: (1, 2), 4: (2, 1)}
"""HSDP meshes of 2 replicas: world size -> (shards per replica, the world size whose checkpoint it loads). At 2 ranks
the 2-shard checkpoint loads into shards of 1; at 4 the 1-process checkpoint into 2 replicas of 2 shards (the split
blocks' scales reduced over each replica's shard group, not the world)."""
ACCELERATE_NAMES = ["adamw_8bit", "adamw_4bit"]
ACCELERATE_KINDS = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]


def elastic_checkpoint(checkpoint_dir: str, world_size: int) -> str:
    return f"{checkpoint_dir}/elastic-{world_size}"


def fsdp2_on(mesh=None):
    def wrap(module):
        fully_shard(module, mesh=mesh)
        return module

    return wrap


def elastic_runs(checkpoint_dir: str) -> dict:
    """Every world-size case at this world size: trained straight for all steps; saved after SAVE_AT steps (one DCP
    checkpoint of every case); and resumed from the checkpoint world size LOADS[W] wrote."""
    world = dist.get_world_size()
    straight, saved = {}, {}
    for name in elastic.CONFIGS:
        module = fsdp2(elastic.model())
        optimizer = elastic.build(name, module)
        elastic.train(module, optimizer, range(elastic.SAVE_AT))
        if name in SAVES[world]:
            model_state, optim_state = get_state_dict(module, optimizer)
            saved[name] = {"model": model_state, "optim": optim_state}
        straight[name] = (module, optimizer)
    if saved:
        dcp.save(saved, checkpoint_id=elastic_checkpoint(checkpoint_dir, world))
    for module, optimizer in straight.values():
        elastic.train(module, optimizer, range(elastic.SAVE_AT, elastic.STEPS))
    results = {"straight": {name: elastic.whole_params(module) for name, (module, _) in straight.items()},
               "dtypes": {name: state_dtypes(module, optimizer) for name, (module, optimizer) in straight.items()}}
    results[f"from {LOADS[world]}"] = resumed_runs(elastic_checkpoint(checkpoint_dir, LOADS[world]), fsdp2,
                                                   elastic.FEW)
    if world in HSDP:
        from torch.distributed.device_mesh import init_device_mesh

        shards, saved = HSDP[world]
        mesh = init_device_mesh("cpu", (2, shards), mesh_dim_names=("replicate", "shard"))
        results[f"hsdp2x{shards} from {saved}"] = resumed_runs(elastic_checkpoint(checkpoint_dir, saved),
                                                               fsdp2_on(mesh), elastic.FEW)
    return results


def resumed_runs(path: str, wrap, names) -> dict:
    """A fresh model (other weights) and optimizer of each case ``names`` load the checkpoint at ``path`` and train
    the remaining steps."""
    built, templates = {}, {}
    for name in names:
        module = elastic.model()
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)  # the checkpoint, not the initialization, decides where training resumes
        module = wrap(module)
        optimizer = elastic.build(name, module)
        model_state, optim_state = get_state_dict(module, optimizer)
        templates[name] = {"model": model_state, "optim": optim_state}
        built[name] = (module, optimizer)
    dcp.load(templates, checkpoint_id=path)
    results = {}
    for name, (module, optimizer) in built.items():
        set_state_dict(module, optimizer, model_state_dict=templates[name]["model"],
                       optim_state_dict=templates[name]["optim"])
        steps = sorted({s["step"] for s in optimizer.state.values()})
        elastic.train(module, optimizer, range(elastic.SAVE_AT, elastic.STEPS))
        results[name] = {"params": elastic.whole_params(module), "loaded_steps": steps}
    return results


def accelerate_elastic_runs(checkpoint_dir: str) -> dict:
    """accelerate's save_fsdp_optimizer at 2 ranks and load_fsdp_optimizer at 3 (what the Trainer calls under FSDP),
    sharded (DCP) and full: the loading twin trains the first steps itself (the optimizer checkpoint holds no
    weights), loads the optimizer and trains on. The test process loads the same checkpoints at 1 rank."""
    from accelerate import PartialState

    state = PartialState(cpu=True)
    results = {}
    for kind in ACCELERATE_KINDS:
        for name in ACCELERATE_NAMES:
            path = f"{checkpoint_dir}/accelerate-elastic-{kind}/{name}"
            if dist.get_world_size() == 2:
                accelerate_saved(kind, name, state, path)
            else:
                results[f"{name} {kind}"] = accelerate_resumed(kind, name, state, path)
    return results


def accelerate_saved(kind: str, name: str, state, path: str) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_optimizer

    module = fsdp2(elastic.model())
    optimizer = elastic.build(name, module)
    elastic.train(module, optimizer, range(elastic.SAVE_AT))
    save_fsdp_optimizer(FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=kind), state, optimizer,
                        module, path)


def accelerate_resumed(kind: str, name: str, state, path: str) -> dict[str, torch.Tensor]:
    """The whole parameters after SAVE_AT steps of its own, the optimizer loaded from ``path``, and the rest."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import load_fsdp_optimizer

    module = fsdp2(elastic.model())
    elastic.train(module, elastic.build(name, module), range(elastic.SAVE_AT))
    module.zero_grad(set_to_none=True)
    resumed = elastic.build(name, module)
    load_fsdp_optimizer(FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=kind), state, resumed, module,
                        path)
    elastic.train(module, resumed, range(elastic.SAVE_AT, elastic.STEPS))
    return elastic.whole_params(module)


COUNTED = ("adamw_8bit", "adamw_fp8", "adamw_4bit", "adamw_rank1")
ALIGNED = {"rows": (12, 256), "narrow": (24, 128), "bias": (33,)}
"""Matrices whose shard boundaries fall on block boundaries at 2, 3 and 4 ranks (parts of 6, 4 or 3 rows of 256, and
12, 8 or 6 rows of 128: whole blocks of 256 and 128), and a vector with fp32 state."""


def collectives_per_step() -> dict:
    """The all-reduces and point-to-point batches (torch.distributed's functions, counted where hf_optim calls them)
    of one optimizer step after the first, for AdamW in each quantized format: on ``ALIGNED`` (no block split by a
    shard boundary) and on the world-size cases' model (split blocks in several tensors)."""
    calls = {"all_reduce": 0, "p2p": 0}
    all_reduce, batch = dist.all_reduce, dist.batch_isend_irecv

    def counted_all_reduce(*args, **kwargs):
        calls["all_reduce"] += 1
        return all_reduce(*args, **kwargs)

    def counted_batch(*args, **kwargs):
        calls["p2p"] += 1
        return batch(*args, **kwargs)

    def aligned_model() -> torch.nn.Module:
        gen = torch.Generator().manual_seed(0)
        module = torch.nn.Module()
        for name, shape in ALIGNED.items():
            setattr(module, name, torch.nn.Parameter(torch.randn(*shape, generator=gen)))
        return module

    results = {}
    for model_name, make in (("aligned", aligned_model), ("split", elastic.model)):
        for name in COUNTED:
            module = fsdp2(make())
            optimizer = elastic.build(name, module)
            for step in range(2):
                for p in module.parameters():
                    p.grad = distribute_tensor(torch.full(p.shape, 0.01 * (step + 1)), p.device_mesh, p.placements,
                                               src_data_rank=None)
                calls.update(all_reduce=0, p2p=0)
                dist.all_reduce, dist.batch_isend_irecv = counted_all_reduce, counted_batch
                try:
                    optimizer.step()
                finally:
                    dist.all_reduce, dist.batch_isend_irecv = all_reduce, batch
            results[f"{model_name} {name}"] = dict(calls)
    return results


def gathered_8bit_state() -> dict:
    """The full (gathered) optimizer state dict of AdamW8bit after SAVE_AT steps at this world size."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    module = fsdp2(elastic.model())
    optimizer = elastic.build("adamw_8bit", module)
    elastic.train(module, optimizer, range(elastic.SAVE_AT))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(module, optimizer, options=options)


def trainer_elastic_resume(checkpoint_dir: str) -> dict:
    """The Trainer of trainer_ddp_resume_runs (2 ranks), resumed from its step-2 checkpoint at this world size."""
    from pathlib import Path

    from trainer_helpers import checkpointing_trainer, inner_optimizer, losses

    source = Path(checkpoint_dir) / f"trainer-{TRAINER_NAMES[0]}" / "out" / "checkpoint-2"
    root = Path(checkpoint_dir) / f"trainer-elastic-{dist.get_world_size()}"
    snapshot = loaded_state_callback()
    resumed = checkpointing_trainer(root, TRAINER_NAMES[0], max_steps=4, save_steps=2, seed=1, callbacks=[snapshot])
    resumed.train(resume_from_checkpoint=str(source))
    return {"world_size": resumed.args.world_size, "optimizer": type(inner_optimizer(resumed)).__name__,
            "loaded": snapshot.state, "losses": losses(resumed), "global_step": resumed.state.global_step,
            "steps": sorted({s["step"] for s in inner_optimizer(resumed).state.values()})}


def loaded_state_callback():
    """A Trainer callback that keeps (a copy of) the optimizer's state dict as training begins: after a resume has
    loaded it, before any step."""
    import copy

    from transformers import TrainerCallback

    class LoadedState(TrainerCallback):
        state = None

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            self.state = copy.deepcopy(getattr(optimizer, "optimizer", optimizer).state_dict())

    return LoadedState()


PER_SHARD_NAMES = ["adamw_8bit", "adamw_4bit"]


def per_shard_runs(checkpoint_dir: str) -> dict:
    """Checkpoints in hf_optim's earlier per-shard layout (8-bit and 4-bit blocks of each rank's local tensor, absmax
    as one padded row per shard), written here by the code that still keeps that layout for sharded parameters
    without a contiguous part (made to apply to every parameter): at 2 ranks they load into the whole-tensor layout
    (sharded, per-rank files and full state dicts), each shard's values decoded with its own blocks and stored with the
    whole tensor's; at 3 ranks the full state dict (written here) is refused."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from hf_optim.optim import shard_layout, sharded_blocks

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    results = {}
    for name in PER_SHARD_NAMES:
        path = f"{checkpoint_dir}/per-shard-{name}.pt"
        if dist.get_world_size() == 3:
            module = fsdp2(elastic.model())
            optimizer = elastic.build(name, module)
            try:
                set_optimizer_state_dict(module, optimizer, torch.load(path, weights_only=False), options=full)
                results[name] = "loaded"
            except ValueError as error:
                results[name] = str(error)
            continue
        compute_part = shard_layout._compute_part
        shard_layout._compute_part = lambda p: shard_layout.Unsupported("the per-shard layout of the test")
        try:
            module = fsdp2(elastic.model())
            optimizer = elastic.build(name, module)
            elastic.train(module, optimizer, range(elastic.SAVE_AT))
            sharded = get_optimizer_state_dict(module, optimizer)
            whole = get_optimizer_state_dict(module, optimizer, options=full)
            dcp.save({"optimizer": sharded}, checkpoint_id=f"{path}.dcp")
            saved = {n: decoded(optimizer, p) for n, p in module.named_parameters()}
        finally:
            shard_layout._compute_part = compute_part
        if dist.get_rank() == 0:  # with cpu_offload the full state dict is rank 0's only: every rank reads the file
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            torch.save(whole, path)
            dcp_to_torch_save(f"{path}.dcp", f"{path}.from-dcp")  # the guide's way from an old DCP folder
        dist.barrier()
        whole = torch.load(path, weights_only=False)
        from_dcp = torch.load(f"{path}.from-dcp", weights_only=False)["optimizer"]
        loaded = {}
        for kind, state in (("sharded", sharded), ("full", whole), ("dcp", from_dcp)):
            twin = fsdp2(elastic.model())
            resumed = elastic.build(name, twin)
            set_optimizer_state_dict(twin, resumed, state, options=None if kind == "sharded" else full)
            parts = {n: shard_layout.part_of(p) for n, p in twin.named_parameters()}
            loaded[kind] = {n: decoded(resumed, p, parts[n]) for n, p in twin.named_parameters()}
            loaded[kind + " steps"] = sorted({s["step"] for s in resumed.state.values()})
            loaded[kind + " apart"] = sorted(n for n, part in parts.items() if sharded_blocks.steps_apart(
                part, resumed.state[dict(twin.named_parameters())[n]], resumed._rules.main.slots))
        results[name] = {"saved": saved, **loaded}
    return results


def decoded(optimizer, param, part=None) -> dict[str, torch.Tensor]:
    """Each state slot's fp32 values of ``param``, gathered whole (a part's own elements, or the local tensor's)."""
    from torch.distributed.tensor import DTensor

    from hf_optim.core.state_store import read_slot
    from hf_optim.optim import sharded_blocks

    state, local = optimizer.state[param], param.to_local()
    out = {}
    for spec in optimizer._rules.main.slots:
        if isinstance(part, sharded_blocks.Part):
            values = sharded_blocks.read_part(part, state, spec)
        else:
            values = read_slot(state, spec, local.numel())
        values = values.reshape(local.shape if spec.rows == 1 else (spec.rows, *local.shape))
        dims = (None,) * (spec.rows > 1) + tuple(range(param.dim()))
        out[spec.key] = DTensor.full_tensor(sharding.distribute_state(values, param, dims))
    return out


def main(out_file: str, checkpoint_dir: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    if world == 2:
        results = {
            "ddp": data_parallel_runs(DistributedDataParallel),
            "fsdp2": data_parallel_runs(fsdp2),
            "resume": checkpoint_resume_runs(checkpoint_dir),
            "accelerate": accelerate_resume_runs(checkpoint_dir),
            "trainer_ddp": trainer_ddp_resume_runs(checkpoint_dir),
            "release": release_refusals(checkpoint_dir),
        }
    else:
        results = {}
    results["elastic"] = elastic_runs(checkpoint_dir)
    results["collectives"] = collectives_per_step()
    if world in (2, 3):
        results["accelerate_elastic"] = accelerate_elastic_runs(checkpoint_dir)
    if world in (2, 3):
        results["per_shard"] = per_shard_runs(checkpoint_dir)
    if world == 3:
        results["gathered_8bit"] = gathered_8bit_state()
        results["trainer_elastic"] = trainer_elastic_resume(checkpoint_dir)
    if dist.get_rank() == 0:
        torch.save(results, out_file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
