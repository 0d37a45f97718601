"""Host time per optimizer step under FSDP2 (gloo, CPU ranks), this tree against another (main), side by side: what
the whole-tensor blocks cost (hf_optim/optim/sharded_blocks.py: split blocks stepped apart, one all-reduce of their
scales per step and shard group; rank-1 column scales all-reduced per tensor).

    python benchmarks/performance/fsdp_boundaries.py                       # against `main` (git archive), 2 ranks
    python benchmarks/performance/fsdp_boundaries.py --baseline /work/main  # against a checkout
    python benchmarks/performance/fsdp_boundaries.py --ranks 3 --cap 200   # shard boundaries inside blocks

The tensors are Llama-3.2-1B's (146: embedding, 16 layers of 7 projections and 2 norms, the final norm), each
dimension capped at ``--cap`` (default 256) so that a step's arithmetic is small and its host work (per tensor:
planning, the path choice, the boundary blocks and their collectives) is what is timed, as in host_overhead.py. The
cap keeps what decides the boundary work: at 2 ranks every real shard boundary of Llama-3.2-1B falls on a block
boundary (rows of 2048 or 8192 elements; the norms, 2048 elements, keep fp32 state), and so does every capped one
(rows of 256): no block is split, no collective runs. ``--cap 200`` (rows of 200 elements) puts a boundary inside a
block of every matrix, the work this tree adds where shapes do not align.

Each tree runs in its own ``torchrun`` (``--ranks`` processes, one thread each, eager PyTorch path:
``HF_OPTIM_COMPILE=0``): FSDP2 (``fully_shard``) over the tensors, fixed gradients, ``--warmup`` steps, then
``--repeats`` rounds of ``--steps`` steps. Prints per optimizer and tree: ms per step on rank 0 (median round; wall
clock, and the thread's CPU time, which on a busy machine leaves out time other processes had the core; ``--runs``
runs per tree, alternating, the median of their medians); in this tree, the part of it spent on the boundary work
(the path choice, split blocks stepped apart, the scales' reduction and the encoding that waited for it, timed
around those functions); the collectives per step (all-reduces and point-to-point
batches hf_optim called), the tensors that step apart (a split block, or rank-1's column scales), and whether each
tree's parameters after the run equal, bit for bit, what one process reaches with the same steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="main",
                        help="a checkout's path, or a git ref of this repository to extract (default: main)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cap", type=int, default=256, help="largest dimension of Llama-3.2-1B's tensors")
    parser.add_argument("--optimizers", default="AdamW8bit,AdamW4bit,AdamW4bitRank1")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=int, default=2, help="runs of each tree, alternating (baseline, this, ...)")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def tensor_set(cap: int) -> list[tuple[int, ...]]:
    sys.path.insert(0, str(HERE))
    from step_time import LLAMA_3_2_1B, llama_shapes

    return [tuple(min(d, cap) for d in shape) for shape in llama_shapes(LLAMA_3_2_1B)]


def tensors_and_grads(shapes):
    """The parameters (a ParameterList) and their whole gradients, the same in every process."""
    import torch

    module = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 0.1)
        for i, shape in enumerate(shapes))
    gen = torch.Generator().manual_seed(1)
    return module, [torch.randn(p.shape, generator=gen) * 0.01 for p in module]


def one_process(name: str, args):
    """The parameters one process reaches with the same steps (this tree's hf_optim)."""
    import torch

    import hf_optim

    torch.set_num_threads(1)
    module, grads = tensors_and_grads(tensor_set(args.cap))
    optimizer = getattr(hf_optim, name)(module.parameters(), lr=1e-3)
    for p, g in zip(module, grads):
        p.grad = g
    for _ in range(args.warmup + args.repeats * args.steps):
        optimizer.step()
    return [p.detach() for p in module]


# --------------------------------------------------------------------------------------------------------------
# The torchrun worker (runs with the tree under test first on PYTHONPATH)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    import hf_optim

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    shapes = tensor_set(args.cap)
    calls = {"all_reduce": 0, "p2p": 0}
    all_reduce, batch = dist.all_reduce, dist.batch_isend_irecv

    def counted_all_reduce(*a, **k):
        calls["all_reduce"] += 1
        return all_reduce(*a, **k)

    def counted_batch(*a, **k):
        calls["p2p"] += 1
        return batch(*a, **k)

    dist.all_reduce, dist.batch_isend_irecv = counted_all_reduce, counted_batch
    spent = timed_boundary_work()
    results = {"hf_optim": str(Path(hf_optim.__file__).parent)}
    for name in args.optimizers.split(","):
        module, whole_grads = tensors_and_grads(shapes)
        fully_shard(module)
        grads = [distribute_tensor(g, p.device_mesh, p.placements) for p, g in zip(module, whole_grads)]
        optimizer = getattr(hf_optim, name)(module.parameters(), lr=1e-3)
        for p, g in zip(module, grads):
            p.grad = g
        for _ in range(args.warmup):
            optimizer.step()
        walls, cpus = [], []
        calls.update(all_reduce=0, p2p=0)
        spent.update(wall=0.0, cpu=0.0)
        for _ in range(args.repeats):
            dist.barrier()
            wall, cpu = 0.0, 0.0
            for _ in range(args.steps):
                start, start_cpu = time.perf_counter(), time.thread_time()
                optimizer.step()
                wall += time.perf_counter() - start
                cpu += time.thread_time() - start_cpu
            walls.append(wall / args.steps * 1e3)
            cpus.append(cpu / args.steps * 1e3)
        per_step = {kind: count / (args.repeats * args.steps) for kind, count in calls.items()}
        split = 0
        try:
            from hf_optim.optim import shard_layout, sharded_blocks

            for p in module:
                part = shard_layout.part_of(p)
                state = optimizer.state[p]
                split += isinstance(part, shard_layout.Part) and sharded_blocks.steps_apart(
                    part, state, optimizer._rules.main.slots)
        except ImportError:  # the baseline: no whole-tensor blocks
            split = None
        params = [p.full_tensor() for p in module]
        if dist.get_rank() == 0:
            results[name] = {"wall_ms": statistics.median(walls), "cpu_ms": statistics.median(cpus),
                             "calls": per_step, "apart": split, "tensors": len(shapes),
                             "boundary_ms": spent["wall"] / (args.repeats * args.steps) * 1e3,
                             "boundary_cpu_ms": spent["cpu"] / (args.repeats * args.steps) * 1e3}
            torch.save(params, f"{args.worker}.{name}.pt")
    if dist.get_rank() == 0:
        Path(args.worker).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def timed_boundary_work() -> dict:
    """Time (wall and thread CPU) spent in what this tree adds for sharded parameters: choosing the path
    (``Runner.part_apart``), stepping split blocks apart, and reducing and encoding their scales (the flush, and the
    per-tensor reduction of rank-1's columns). Nothing in a tree without them (the baseline)."""
    spent = {"wall": 0.0, "cpu": 0.0, "depth": 0}
    try:
        from hf_optim.optim import runner, sharded_blocks
    except ImportError:
        return spent

    def timed(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            spent["depth"] += 1
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent["depth"] -= 1
                if not spent["depth"]:  # the outermost timed call only
                    spent["wall"] += time.perf_counter() - start
                    spent["cpu"] += time.thread_time() - start_cpu

        setattr(owner, name, wrapper)

    timed(runner.Runner, "part_apart")
    timed(sharded_blocks, "_step_split_run")
    timed(sharded_blocks.PendingScales, "flush")
    timed(sharded_blocks, "reduce_whole")
    return spent


# --------------------------------------------------------------------------------------------------------------
# The comparison


def baseline_tree(spec: str, scratch: Path) -> Path:
    if Path(spec).is_dir():
        return Path(spec).resolve()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", spec, "hf_optim"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive.stdout, check=True)
    return scratch


def run_tree(tree: Path, args, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(HERE)]), "OMP_NUM_THREADS": "1",
           "HF_OPTIM_COMPILE": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks),
               str(Path(__file__).resolve()), "--worker", str(out), "--cap", str(args.cap),
               "--optimizers", args.optimizers, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--repeats", str(args.repeats)]
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"error: the run with {tree} failed:\n{run.stderr[-3000:]}")
    return json.loads(out.read_text())


def merged(runs: list[dict]) -> dict:
    """One tree's runs: the median of their medians."""
    out = dict(runs[0])
    for name, first in runs[0].items():
        if isinstance(first, dict):
            out[name] = {**first, **{key: statistics.median(run[name][key] for run in runs)
                                     for key in ("wall_ms", "cpu_ms", "boundary_ms", "boundary_cpu_ms")}}
    return out


def main() -> None:
    args = _parse()
    if args.worker:
        worker(args)
        return
    import torch

    os.environ["HF_OPTIM_COMPILE"] = "0"
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        (scratch / "baseline").mkdir()
        baseline = baseline_tree(args.baseline, scratch / "baseline")
        bases, ourses = [], []
        for run in range(args.runs):  # alternating, so that a change in the machine's load hits both
            bases.append(run_tree(baseline, args, scratch / f"base{run}.json"))
            ourses.append(run_tree(ROOT, args, scratch / f"ours{run}.json"))
        base, ours = merged(bases), merged(ourses)
        print(f"FSDP2, {args.ranks} gloo ranks, Llama-3.2-1B tensors capped at {args.cap} "
              f"({ours[args.optimizers.split(',')[0]]['tensors']} tensors); {args.runs} runs per tree, alternating, "
              f"each {args.repeats} rounds of {args.steps} steps: median; ms per optimizer step on rank 0")
        print(f"  baseline: {base['hf_optim']}\n  this tree: {ours['hf_optim']}")
        header = ("optimizer", "baseline wall", "this wall", "ratio", "baseline cpu", "this cpu", "ratio",
                  "boundary work (wall, cpu)", "collectives/step", "tensors apart", "= one process (baseline, this)")
        rows = [header]
        for name in args.optimizers.split(","):
            b, o = base[name], ours[name]
            reference = one_process(name, args)
            exact = ["yes" if all(torch.equal(x, y) for x, y in zip(torch.load(f"{scratch}/{tree}0.json.{name}.pt"),
                                                                   reference)) else "no"
                     for tree in ("base", "ours")]
            calls = " + ".join(f"{count:g} {kind}" for kind, count in o["calls"].items() if count) or "0"
            rows.append((name, f"{b['wall_ms']:.2f}", f"{o['wall_ms']:.2f}", f"{o['wall_ms'] / b['wall_ms']:.2f}",
                         f"{b['cpu_ms']:.2f}", f"{o['cpu_ms']:.2f}", f"{o['cpu_ms'] / b['cpu_ms']:.2f}",
                         f"{o['boundary_ms']:.2f}, {o['boundary_cpu_ms']:.2f}", calls,
                         f"{o['apart']}/{o['tensors']}", ", ".join(exact)))
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
        for row in rows:
            print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


if __name__ == "__main__":
    main()
