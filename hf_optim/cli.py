"""The ``hf-optim`` command: train, validate, ls, cp, plot, compare, optimizers, run, doctor (``--help`` on each).

Also runs as ``python -m hf_optim.cli``. Only the standard library is imported before a verb runs: ``run`` and
``optimizers`` work on an install without extras, and a verb whose extra is missing says which one to install.
torch is imported only after the checks that need none have passed (:mod:`hf_optim._startup`,
:mod:`hf_optim.recipes.quickcheck`): ``--help``, a mistyped recipe, optimizer name or key, an output directory that
holds a run, or a run directory that does not exist are answered at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import sys
from pathlib import Path

EXAMPLES = """examples:
  hf-optim train quickstart                                   # the tiny offline QLoRA run (CPU, about 45 s)
  hf-optim run -- trl sft --optim lamb_8bit ...               # another command line, with hf_optim's names
  hf-optim validate llama-3.1-8b-full training.optim=adamw_torch
  hf-optim validate llama-3.1-8b-full --fit 24GiB                # which setups fit a 24 GB card, largest batch
  hf-optim train llama-3.2-1b-qlora --smoke                   # any recipe, a few steps on CPU
  hf-optim train llama-3.2-1b-full --sweep training.optim=adamw_torch,adamw_8bit,paged_adamw_8bit
  hf-optim doctor                                             # versions, devices, a self-test of the kernels here
"""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (argparse prints the usage block first): ``hf-optim train: error: ...``."""

    def error(self, message: str):
        if message.startswith("the following arguments are required: recipe"):  # argparse also names the overrides
            message = ("a recipe is required: a recipe file or the name of a bundled one (`hf-optim ls` lists them, "
                       "e.g. quickstart)")
        choice = re.match(r"argument \S+: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:  # argparse before Python 3.14 has no did-you-mean
            from hf_optim.errors import suggest

            close = suggest(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)), count=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hf-optim", description="Fine-tune with recipes and hf_optim's memory-efficient optimizers.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    def recipe_args(sub):
        sub.add_argument("recipe", help="a recipe file, or the name of a bundled recipe (hf-optim ls)")
        sub.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE",
                         help="overrides, values read as YAML scalars (training.optim=lamb_8bit, peft.r=32)")
        sub.add_argument("--smoke", action="store_true",
                         help="smoke mode (also HF_OPTIM_SMOKE=1): the builtin tiny model and bundled data, a few "
                              "steps on CPU; the recipe's method (full/LoRA/QLoRA) and optimizer are kept")
        sub.add_argument("-v", "--verbose", action="store_true",
                         help="show everything the libraries print (by default: hf_optim's lines, one progress bar, "
                              "and other packages' warnings except deprecation notices about their own code)")

    train = verbs.add_parser("train", help="train a recipe (or sweep one key over several values)",
                             description="Train a recipe. Writes the resolved recipe.yaml, metrics.jsonl, "
                                         "summary.json and plots into the output directory.")
    recipe_args(train)
    train.add_argument("--sweep", metavar="KEY=V1,V2,...",
                       help="one run per value, each in its own subdirectory, then compare them "
                            "(e.g. training.optim=adamw_torch,adamw_8bit,paged_adamw_8bit); OOM runs become OOM rows")
    train.add_argument("--output-dir", help="run directory (default: training.output_dir, else runs/<recipe>)")
    train.add_argument("--resume", nargs="?", const="auto", metavar="auto|PATH",
                       help="continue the run in the output directory from its last complete checkpoint (auto, the "
                            "default), or from a checkpoint-N folder or run directory; with --sweep, every run of the "
                            "sweep continues (finished ones are kept)")
    train.add_argument("--overwrite", action="store_true",
                       help="start again from step 0 in an output directory that holds a run (its checkpoints and "
                            "logs are deleted first); without --resume or --overwrite such a directory is refused")
    train.add_argument("--random-weights", action="store_true",
                       help="measure before you download: build the recipe's model from its architecture with random "
                            "weights (offline), train a few steps as the recipe says (bundled tokenizer and data), and "
                            "write memory_by_component.json: measured peak memory by component beside the estimate")
    train.add_argument("--steps", type=int, help="with --random-weights: optimizer steps (default 3)")
    train.add_argument("--seq-len", type=int, help="with --random-weights: tokens per sequence (training.max_length)")
    train.add_argument("--batch-size", type=int,
                       help="with --random-weights: sequences per device batch (per_device_train_batch_size)")

    validate = verbs.add_parser("validate", help="check a recipe offline and estimate its training memory",
                                description="Check every key against the installed classes and the optimizer "
                                            "name, then estimate weights + gradients + optimizer-state memory "
                                            "from the architecture (meta device, no download).")
    recipe_args(validate)
    validate.add_argument("--no-estimate", action="store_true", help="check keys only")
    validate.add_argument("--fit", metavar="MEMORY",
                          help="plan a full fine-tune on a card of this size (24GiB, 80G, 40GB, 24000MB): which "
                               "optimizer precision / paging / gradient release / checkpointing setups fit, and "
                               "the largest batch of each")

    verbs.add_parser("ls", help="list the bundled recipes", description="List the bundled recipes.")
    cp = verbs.add_parser("cp", help="copy a bundled recipe to edit it",
                          description="Copy a bundled recipe (a file that extends another keeps extending the "
                                      "bundled one).")
    cp.add_argument("name", help="bundled recipe name (hf-optim ls)")
    cp.add_argument("dest", help="destination file or directory")

    plot = verbs.add_parser("plot", help="(re)draw the plots of a run directory",
                            description="Redraw loss.png, memory.png and dashboard.png of a run directory.")
    plot.add_argument("run_dir")
    compare = verbs.add_parser("compare", help="compare runs: compare.md and loss/memory/speed plots",
                               description="Compare run directories (e.g. the runs of a sweep).")
    compare.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    compare.add_argument("--out", default=None, help="where compare.md and the plots go (default: the current "
                                                     "directory)")
    compare.add_argument("--baseline", default=None, help="the run the deltas are against (default: the first)")
    verbs.add_parser("optimizers", help="the optim= names hf_optim answers to",
                     description="Every training.optim name hf_optim builds, with its class, precision and paging.")
    run = verbs.add_parser("run", help="run a command (trl sft, accelerate launch, ...) with hf_optim's names",
                           add_help=False)
    run.add_argument("command", nargs=argparse.REMAINDER, help="hf-optim run --help")
    doctor = verbs.add_parser("doctor", help="versions, devices and a self-test of the kernels on this machine",
                              add_help=False)
    doctor.add_argument("options", nargs=argparse.REMAINDER, help="hf-optim doctor --help")
    return parser


def _gb(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else f"{nbytes / 1e9:,.2f}"


def _gib(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else f"{nbytes / 2**30:,.2f}"


def _per_param(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


def cmd_validate(args, console) -> int:
    from rich.table import Table

    from hf_optim.recipes.api import load_recipe
    from hf_optim.recipes.preflight import preflight

    card_bytes = None
    if args.fit is not None:
        from hf_optim.recipes.fit import parse_memory

        card_bytes = parse_memory(args.fit)
    recipe = load_recipe(args.recipe, args.overrides, args.smoke)
    warnings = preflight(recipe, this_machine=False)  # what train checks before loading the model
    console.print(f"[green]ok[/green] {recipe.source}: keys, types and optimizer {recipe.optim!r} are valid, and so is "
                  f"what train checks before loading the model ({recipe.method}, model {recipe.model['id']})",
                  highlight=False)
    for warning in warnings:
        console.print(f"[yellow]warning[/yellow]: {warning}", highlight=False)
    if recipe.hardware:
        console.print(f"target hardware: {recipe.hardware}")
    for note in recipe.notes:
        console.print(f"note: {note}")
    if args.no_estimate:
        return 0
    from hf_optim.recipes.estimate import estimate

    try:
        est = estimate(recipe)
    except LookupError as exc:  # an unknown architecture offline: the keys are still valid
        console.print(f"no memory estimate: {exc}")
        return 0
    table = Table(title=f"Training memory estimate: {est.model_id}, {est.method}, optim={est.optim}")
    table.add_column("part")
    table.add_column("bytes", justify="right")
    table.add_column("GB", justify="right")
    table.add_column("GiB", justify="right")
    table.add_column("bytes/param", justify="right")
    rows = [("weights", est.weights_bytes), ("gradients", est.gradient_bytes), ("optimizer state", est.state_bytes),
            ("total (without activations)", est.total_bytes)]
    for name, value in rows:
        table.add_row(name, "unknown" if value is None else f"{value:,}", _gb(value), _gib(value),
                      _per_param(est.per_param(value)))
    console.print(table)
    console.print(f"parameters: {est.total_params:,} total, {est.trainable_params:,} trainable; "
                  f"architecture from: {est.config_source}; bytes/param: per model parameter")
    for note in est.notes:
        console.print(f"note: {note}")
    if card_bytes is not None:
        return _print_fit(recipe, card_bytes, console)
    return 0


def _uncut_table(title: str, columns: list[tuple[str, str]], rows: list[tuple[str, ...]], width: int,
                 optional: tuple[str, ...] = ()):
    """A rich table whose cells are never cut or wrapped (numbers and names are read whole: ``19.…`` is no
    figure); headers wrap (and fold) instead. On a terminal too narrow for every column, the ``optional`` ones are
    left out, in that order, until the rest fits. Returns (table, the headers left out)."""
    from rich.table import Table

    # a column needs its longest cell; its header wraps, and folds within a word when it must
    widths = {name: max([1] + [len(row[i]) for row in rows]) for i, (name, _) in enumerate(columns)}
    kept, left_out = list(columns), []
    for name in optional:
        if sum(widths[n] + 3 for n, _ in kept) + 1 <= width:
            break
        kept = [c for c in kept if c[0] != name]
        left_out.append(name)
    natural = sum(max(len(name), widths[name]) + 3 for name, _ in kept) + 1
    table = Table(title=title)
    for name, justify in kept:  # too narrow for whole headers: each column as narrow as its cells, headers wrapped
        table.add_column(name, justify=justify, overflow="fold", width=None if natural <= width else widths[name])
    index = {name: i for i, (name, _) in enumerate(columns)}
    for row in rows:
        table.add_row(*(row[index[name]] for name, _ in kept))
    return table, left_out


def _print_fit(recipe, card_bytes: int, console) -> int:
    """The --fit table: every setup that fits, ranked, with its largest batch; or why nothing does."""
    from hf_optim.recipes.fit import gib, nothing_fits_message, plan, release_note, state_label

    try:
        result = plan(recipe, card_bytes)
    except ValueError as exc:
        console.print(f"no fit plan: {exc}")
        return 0
    batch = result.recipe_batch
    title = (f"Fit on a {gib(card_bytes)} GiB card ({card_bytes / 1e9:,.2f} GB): {result.estimate.model_id}, full "
             f"fine-tune, {result.seq_len} tokens per sequence")
    columns = [("#", "right"), ("optimizer", "left"), ("state", "left"), ("paged", "left"), ("grads", "left"),
               ("ckpt", "left"), ("B/param", "right"), (f"GiB at batch {batch} (est.)", "right"),
               ("largest batch (est.)", "right")]
    rows = []
    for rank, fit in enumerate(result.fits, 1):
        s = fit.setup
        peak = fit.batch_bytes[batch]
        rows.append((str(rank), s.optim, state_label(s), "yes" if s.paged else "no",
                     "released" if s.release else "kept", "on" if s.checkpointing else "off",
                     f"{fit.bytes_per_param:.2f}", gib(peak) + ("" if peak <= result.usable_bytes else " (over)"),
                     str(fit.max_batch)))
    table, left_out = _uncut_table(title, columns, rows, console.width, optional=("state", "paged"))
    if left_out:
        table.caption = (f"{' and '.join(left_out)} left out at {console.width} columns (the optimizer's name says "
                         f"{'it' if len(left_out) == 1 else 'them'})")
    if result.fits:
        console.print(table)
    else:
        console.print(f"[red]{nothing_fits_message(result)}[/red]", highlight=False)
    if result.misfits:
        names = "; ".join(f"{m.setup.label()} ({gib(m.batch_bytes[1])} GiB at batch 1)" for m in result.misfits[:4])
        more = f" and {len(result.misfits) - 4} more" if len(result.misfits) > 4 else ""
        console.print(f"{len(result.misfits)} setup(s) do not fit even at batch 1: {names}{more}", highlight=False)
    over = [fit for fit in result.fits if fit.batch_bytes[batch] > result.usable_bytes]
    if over:
        setting = f"the recipe's batch of {batch} (training.per_device_train_batch_size)"
        if len(over) == len(result.fits) and {fit.max_batch for fit in over} == {1}:
            console.print(f"(over): no setup fits {setting}: each fits at batch 1 only", highlight=False)
        else:
            console.print(f"(over): the setup does not fit {setting}; it fits at the largest batch of the last "
                          "column", highlight=False)
    console.print("B/param: bytes per model parameter of weights + gradients (grads kept: all; released: those "
                  "alive at once) + optimizer state (paged included); activations excluded. paged: the optimizer "
                  "state is in CUDA managed memory, which stays on the GPU while there is room and moves to host "
                  "memory when the GPU is short (steps slow down then); the plan counts it as off the GPU. ckpt: "
                  "activation (gradient) checkpointing", highlight=False)
    note = release_note(result)
    if note:
        console.print(note, highlight=False)
    for assumption in result.assumptions:
        console.print(f"assumption: {assumption}", highlight=False)
    return 0


def cmd_train(args, console) -> int:
    from rich.table import Table

    from hf_optim.recipes import api
    from hf_optim.recipes.interrupt import EXIT_STATUS
    from hf_optim.recipes.rundir import RunDirectoryError

    quiet = not args.verbose
    if args.random_weights or (args.steps, args.seq_len, args.batch_size) != (None, None, None):
        from hf_optim.recipes.real_shape import cli_train

        return cli_train(args, console, quiet)
    if args.sweep:
        if args.resume not in (None, "auto"):
            raise RunDirectoryError(f"--resume {args.resume}: a sweep resumes each of its runs from its own "
                                    "directory; give --resume without a path")
        results, report = api.sweep(args.recipe, args.sweep, args.overrides, args.smoke, args.output_dir,
                                    quiet=quiet, resume=args.resume is not None, overwrite=args.overwrite)
    else:
        result = api.train(args.recipe, args.overrides, args.smoke, args.output_dir, quiet=quiet,
                           resume=args.resume, overwrite=args.overwrite)
    if args.sweep:
        table = Table(title=f"sweep {args.sweep.partition('=')[0]}")
        for column in ("run", "status", "optimizer", "train loss (mean of all logged steps)"):
            table.add_column(column, no_wrap=column != "run", overflow="fold")
        for result in results:
            loss = None if result.status == "oom" else _whole_run_loss(result)
            table.add_row(str(result.output_dir), result.status, result.optimizer or "-",
                          "-" if loss is None else f"{loss:.4f}")
        console.print(table)
        if results[-1].status in ("interrupted", "killed"):
            if not other_rank():
                print(interrupted_line(results[-1], args), file=sys.stderr)
            return results[-1].exit_status or EXIT_STATUS
        console.print(f"comparison: {report}")
        return 0 if all(r.status == "ok" for r in results) else 3
    if result.status in ("interrupted", "killed"):
        if not other_rank():
            print(interrupted_line(result, args), file=sys.stderr)
        return result.exit_status or EXIT_STATUS
    if result.status == "oom":
        console.print(f"[red]out of memory[/red]; recorded in {result.output_dir / 'summary.json'}")
        return 3
    loss, mean_of = result.train_loss, "run mean"
    if result.resumed_from is not None:  # the Trainer's mean covers only the steps after the resume
        loss = _whole_run_loss(result)
        mean_of = f"mean of all logged steps, those before {Path(result.resumed_from).name} included"
    console.print(f"done: optimizer {result.optimizer}, train loss ({mean_of}) {loss:.4f}")
    if result.state is not None:
        parts = ", ".join(f"{dtype} {nbytes / 2**20:.2f}" for dtype, nbytes in sorted(result.state.by_dtype.items()))
        console.print(f"optimizer state: {result.state.total_bytes / 2**20:.2f} MiB ({parts})")
    console.print(f"run directory: {result.output_dir}  (recipe.yaml, metrics.jsonl, summary.json, loss.png, "
                  "memory.png, dashboard.png)")
    return 0


def _whole_run_loss(result) -> float | None:
    """The mean training loss over every logged step of ``result``'s run (a resumed run's earlier steps included),
    read from its metrics.jsonl; the Trainer's mean where nothing was logged there (no monitor)."""
    from hf_optim.monitor.compare import logged_loss_mean

    try:
        logged = logged_loss_mean(result.output_dir)
    except (OSError, ValueError):  # no run files (logging.monitor: false), or unreadable ones
        logged = None
    return logged if logged is not None else result.train_loss


def rerun_command(argv: list[str] | None, resume_value: str | None, flag: str) -> str:
    """``hf-optim train`` with ``argv`` (the arguments after ``train``) less --resume (and ``resume_value``, the path
    argparse gave it), --overwrite and ``training.resume_from_checkpoint=``, plus ``flag``."""
    import shlex

    if argv is None:
        return f"hf-optim train <the same arguments> {flag}".rstrip()
    kept, after_resume = [], False
    for token in argv:
        if after_resume and token == resume_value:
            after_resume = False
            continue
        after_resume = token == "--resume"
        dropped = token == "--overwrite" or token.startswith(("--resume=", "training.resume_from_checkpoint="))
        if after_resume or dropped:
            continue
        kept.append(token)
    return " ".join(part for part in ("hf-optim train", shlex.join(kept), flag) if part)


def interrupted_line(result, args) -> str:
    """The one line ``hf-optim train`` prints after Ctrl-C or SIGTERM: where it stopped and the command that goes
    on."""
    stopped = f"killed by {result.signal}" if result.status == "killed" else "interrupted"
    if result.global_step is None:
        return f"{stopped} before training started"
    argv, resume_value = getattr(args, "argv", None), getattr(args, "resume", None)
    if result.checkpoint is not None:
        where = Path(result.checkpoint).name
        behind = "" if where == f"checkpoint-{result.global_step}" else f" (it goes on from {where})"
        return (f"{stopped} at step {result.global_step}; resume with: "
                f"{rerun_command(argv, resume_value, '--resume')}{behind}")
    from hf_optim.recipes.rundir import inspect

    flag = "--overwrite" if inspect(result.output_dir).holds_a_run else ""
    return (f"{stopped} at step {result.global_step}, before any checkpoint; start again with: "
            f"{rerun_command(argv, resume_value, flag)}")


def cmd_ls(args, console) -> int:
    import yaml
    from rich.table import Table

    from hf_optim.recipes.errors import RecipeError
    from hf_optim.recipes.loading import bundled_dir, bundled_names, load_raw

    rows = []
    for name in bundled_names():
        try:
            data = load_raw(name).data
        except (RecipeError, yaml.YAMLError) as exc:
            rows.append((name, f"[red]{exc}[/red]", "", "", ""))
            continue
        method = "full" if not data.get("peft") else ("qlora" if data.get("quantization") else "lora")
        rows.append((name, str((data.get("model") or {}).get("id", "?")), method,
                     str((data.get("training") or {}).get("optim", "default")), str(data.get("hardware", ""))))
    table = Table(title=f"bundled recipes ({bundled_dir()})")
    # The name and the optimizer are what a user types: never cut (llama-3.2-1b-full and llama-3.2-1b-lora differ at
    # the end); the model id and the hardware fold onto more lines on a narrow terminal, and are left out (said so)
    # on one too narrow to hold them.
    columns = ("name", "model", "method", "optim", "hardware")
    widths = [max((len(row[i]) for row in rows), default=4) for i in range(len(columns))]
    narrow = console.width < sum(widths[i] + 3 for i in (0, 2, 3)) + 2 * (10 + 3) + 1
    shown = [i for i, column in enumerate(columns) if not (narrow and column in ("model", "hardware"))]
    for i in shown:
        key = columns[i] in ("name", "method", "optim")
        table.add_column(columns[i], no_wrap=key, overflow="fold", min_width=widths[i] if key else None)
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    console.print(table)
    if narrow:
        console.print(f"(model and hardware left out at {console.width} columns: a wider terminal shows them)")
    return 0


def cmd_cp(args, console) -> int:
    from hf_optim.recipes.loading import bundled_recipe

    source = bundled_recipe(args.name)
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists():
        from hf_optim.errors import UserError

        raise UserError(f"{dest} exists; not overwritten (give another destination, or remove it first)")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
    except OSError as exc:  # a destination the user named that cannot be written: their problem, not a bug
        from hf_optim.errors import UserError

        raise UserError(f"cannot copy {source.name} to {dest}: {exc.strerror or exc}") from exc
    console.print(f"copied {source.name} -> {dest}")
    return 0


def _print_status_notes(run_dirs: list[str]) -> None:
    """One line per run that did not finish (still running, killed, failed, or whose process is gone)."""
    from hf_optim.monitor.runfiles import load_run, status_note

    for run_dir in run_dirs:
        note = status_note(load_run(Path(run_dir)))
        if note:
            print(f"note: {note}")


def cmd_plot(args, console) -> int:
    from hf_optim.monitor.plots import plot_run

    for path in plot_run(Path(args.run_dir)):
        print(path)  # plain print: plot and compare run with the monitor extra alone, which has no rich
    _print_status_notes([args.run_dir])
    return 0


def cmd_compare(args, console) -> int:
    from hf_optim.monitor.compare import compare_runs

    _print_status_notes(args.run_dirs)
    baseline = Path(args.baseline) if args.baseline else None
    report = compare_runs([Path(d) for d in args.run_dirs], Path(args.out or "."), baseline=baseline)
    print(f"comparison: {report}")
    return 0


def cmd_optimizers(args, console) -> int:
    import hf_optim

    names = hf_optim.available_optimizers()
    if console is None:  # rich is not installed: plain columns
        print(names.table())
    else:
        from rich.table import Table

        rows = list(names.rows())
        # name and class are never cut (paged_adamw_8bit / paged_adamw_32bit differ at the end); state and origin
        # wrap, and origin is left out (said so) on a terminal too narrow for it.
        widths = [max(len(str(row[i])) for row in [names.HEADER, *rows]) for i in range(len(names.HEADER))]
        keys = {"name", "class", "paged"}
        fixed = sum(w + 3 for column, w in zip(names.HEADER, widths) if column in keys) + 1
        dropped = {"origin"} if console.width < fixed + 2 * (10 + 3) else set()
        shown = [i for i, column in enumerate(names.HEADER) if column not in dropped]
        table = Table(title="training.optim names built by hf_optim")
        for i in shown:
            key = names.HEADER[i] in keys
            table.add_column(names.HEADER[i], no_wrap=key, overflow="fold", min_width=widths[i] if key else None)
        for row in rows:
            table.add_row(*(row[i] for i in shown))
        console.print(table)
        if dropped:
            console.print(f"(origin left out at {console.width} columns: a wider terminal shows it)")
    print("transformers' other names (adamw_torch, adafactor, ...) work too: "
          "transformers.training_args.OptimizerNames")
    return 0


COMMANDS = {"train": cmd_train, "validate": cmd_validate, "ls": cmd_ls, "cp": cmd_cp, "plot": cmd_plot,
            "compare": cmd_compare, "optimizers": cmd_optimizers}

TRAIN_EXTRA = {"transformers": "transformers", "trl": "trl", "peft": "peft", "bitsandbytes": "bitsandbytes",
               "datasets": "datasets", "yaml": "pyyaml", "pydantic": "pydantic", "rich": "rich",
               "matplotlib": "matplotlib", "psutil": "psutil"}
"""What the ``train`` extra installs (import name -> distribution), as pyproject.toml lists it."""
MONITOR_MODULES = ("transformers", "yaml", "matplotlib", "psutil")
NEEDS = {"train": tuple(TRAIN_EXTRA), "validate": ("transformers", "trl", "peft", "yaml", "pydantic", "rich"),
         "ls": ("transformers", "trl", "peft", "yaml", "pydantic", "rich"),
         "cp": ("transformers", "trl", "peft", "yaml", "pydantic", "rich"), "plot": MONITOR_MODULES,
         "compare": MONITOR_MODULES, "optimizers": ()}
"""The modules each verb imports; all of them come with the ``train`` extra (plot's and compare's with ``monitor``)."""


def missing_extra(verb: str) -> str | None:
    """The one line to print when a module ``verb`` needs is not installed, else None."""
    missing = [TRAIN_EXTRA[name] for name in NEEDS.get(verb, ()) if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    extra = "monitor" if NEEDS[verb] == MONITOR_MODULES else "train"  # plot, compare: the monitor is enough
    return (f"hf-optim {verb} needs hf_optim's \"{extra}\" extra, which is not installed (missing: "
            f"{', '.join(missing)}): pip install \"hf_optim[{extra}]\" (from a source checkout: "
            f"pip install -e \".[{extra}]\")")


def other_rank() -> bool:
    """Whether this is a process of a multi-process launch (torchrun, ``accelerate launch``, ``deepspeed``) other
    than rank 0. Every rank runs the same command; rank 0 alone prints its summary (``done:``, ``run directory:``)
    and its user errors, which the same command line and config raise on every rank alike."""
    import os

    return os.environ.get("RANK", "0").strip() not in ("", "0")


def _console():
    """A rich console, or None when rich is not installed (only verbs that need no extra get that far); quiet on
    ranks other than 0 (:func:`other_rank`)."""
    if importlib.util.find_spec("rich") is None:
        return None
    from rich.console import Console

    console = Console(soft_wrap=True, quiet=other_rank())
    if not console.is_terminal:  # piped or captured: no wrapping of table cells at 80 columns
        console = Console(soft_wrap=True, width=200, quiet=other_rank())
    return console


def print_error(exc: BaseException) -> None:
    """A user error on stderr, without a traceback: one line, or a header and one line per problem of a recipe
    with several. Red when stderr is a terminal and rich is installed; never wrapped (a wrapped line breaks
    mid-phrase and cannot be searched for). Rank 0 alone prints it under a multi-process launch."""
    if other_rank():
        return
    lines = [line for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    issues = getattr(exc, "issues", None)  # a RecipeError (not imported here: plot and compare run without pydantic)
    several = issues is not None and len(issues) > 1
    label = f"invalid recipe ({len(issues)} problems):" if several else "error:"
    if sys.stderr.isatty() and importlib.util.find_spec("rich") is not None:
        from rich.console import Console
        from rich.markup import escape

        console = Console(stderr=True, soft_wrap=True, highlight=False)
        head = f"[red]{label}[/red]"
        lines = [escape(line) for line in lines]
    else:
        console, head = None, label
    out = [head, *lines] if several else [f"{head} {lines[0]}", *lines[1:]]
    for line in out:
        if console is None:
            print(line, file=sys.stderr)
        else:
            console.print(line)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``); returns the exit status (1: a package the verb needs
    is missing, 2: a user error: an invalid recipe, value, path, environment variable or command line, an output
    directory that holds a run, or the Hugging Face Hub unreachable for files that are not cached; 3: a run ran out
    of memory; 130: Ctrl-C).

    A user error (:class:`hf_optim.errors.UserError`) is printed as one line per problem, without a traceback;
    any other exception is a bug and keeps its traceback."""
    from hf_optim._autoimport import replace_namespace_package
    from hf_optim.errors import OFFLINE_HINT, UserError, hub_unreachable

    shadowed = replace_namespace_package()  # a folder named hf_optim on PYTHONPATH came before the package
    if shadowed:
        print(shadowed, file=sys.stderr)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # everything after `run` belongs to the command it runs: --help, its errors
        from hf_optim import run

        return run.main(argv[1:])
    if argv[:1] == ["doctor"]:  # its own options (hf_optim.doctor reads them before importing torch)
        from hf_optim import doctor

        return doctor.main(argv[1:])
    try:
        return _main(argv)
    except UserError as exc:
        print_error(exc)
        return 2
    except Exception as exc:
        cause = hub_unreachable(exc)
        if cause is None:
            raise
        first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        print_error(UserError(f"the Hugging Face Hub cannot be reached and the files are not cached ({first}); "
                              f"{OFFLINE_HINT}"))
        return 2


def quick_checks(args) -> None:
    """Raise the user errors that need no torch before it is imported (it takes seconds): a recipe name, key or
    optimizer name, an output directory that holds a run (:mod:`hf_optim.recipes.quickcheck`), a run directory
    that ``plot`` or ``compare`` cannot read. What these checks cannot decide the verb's own checks decide next."""
    if args.verb == "validate" and args.no_estimate and args.fit is not None:
        from hf_optim.errors import UserError

        raise UserError(f"--fit {args.fit} plans from the memory estimate, which --no-estimate leaves out: give one "
                        "of them")
    if args.verb in ("train", "validate"):
        import os

        from hf_optim.recipes.quickcheck import quick_check

        smoke = args.smoke or os.environ.get("HF_OPTIM_SMOKE", "0") not in ("", "0")  # smoke.smoke_requested's rule
        plain_run = args.verb == "train" and not args.sweep and args.resume is None and not args.overwrite \
            and not args.random_weights  # which goes to its own directory
        quick_check(args.recipe, args.overrides, smoke, train_into=args.output_dir if plain_run else False,
                    as_given=not getattr(args, "random_weights", False))
    elif args.verb in ("plot", "compare"):
        from hf_optim.monitor.runfiles import load_run

        for run_dir in [args.run_dir] if args.verb == "plot" else args.run_dirs:
            load_run(Path(run_dir))


def _main(argv: list[str]) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also come after options (train RECIPE --smoke training.optim=x): argparse leaves those over.
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        parser.exit(2, f"hf-optim {args.verb}: error: unrecognized arguments: {' '.join(stray)} (see hf-optim "
                       f"{args.verb} --help)\n")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if getattr(args, "resume", None) not in (None, "auto") and "=" in args.resume and not Path(args.resume).exists():
        args.overrides = [*args.overrides, args.resume]  # `--resume key=value`: the override is not --resume's path
        args.resume = "auto"
    if args.verb == "train":
        args.argv = argv[1:]  # for the command that resumes after Ctrl-C
    problem = missing_extra(args.verb)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    try:
        quick_checks(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if args.verb in ("ls", "cp"):  # nothing of torch's needed: read the recipe files and answer
        return COMMANDS[args.verb](args, _console())
    from hf_optim import _startup, notices

    _startup.finish()  # what `import hf_optim` imports (torch, transformers' patch), deferred until now

    notices.show_optional_kernel_notices(getattr(args, "verbose", False))
    try:
        if args.verb in ("optimizers", "plot", "compare"):  # these import no recipe package (pydantic, trl, peft)
            return COMMANDS[args.verb](args, _console())
        from hf_optim.recipes.console import quiet_console

        # entered before the Hugging Face packages are imported: some notices come at import (ls and cp: verbose)
        with quiet_console(not getattr(args, "verbose", True)):
            return COMMANDS[args.verb](args, _console())
    except KeyboardInterrupt:  # Ctrl-C outside training (imports, loading): nothing was trained, nothing to keep
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        notices.show_optional_kernel_notices(False)


if __name__ == "__main__":
    sys.exit(main())
