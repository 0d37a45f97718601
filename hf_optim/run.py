"""``hf-optim run``: another program's command line, with hf_optim's optimizer names, and no code edit.

    hf-optim run -- trl sft --optim lamb_8bit ...
    hf-optim run -- accelerate launch train.py --optim paged_adamw_8bit ...
    hf-optim run -- torchrun --nproc_per_node 2 train.py ...
    accelerate launch -m hf_optim.run train.py ...       # python -m hf_optim.run takes the same arguments

The command is an installed console script (``trl``, ``accelerate``, ``torchrun``: found through its
``console_scripts`` entry point, as the script pip wrote would find it), a Python file, or ``-m MODULE``. It runs in
this process after ``import hf_optim``, with ``sys.argv`` as the program would see it, so its ``--optim`` choices
and ``--help`` list hf_optim's names. Python processes it starts import hf_optim at start-up too (``trl sft`` and
``accelerate launch`` run the training script as a new process, ``torchrun`` one per rank): the directory of
``hf_optim/_autoimport`` goes first on ``PYTHONPATH``, and its ``sitecustomize`` imports hf_optim after running any
``sitecustomize`` it shadows.

Standard library and hf_optim only: this works on an install without extras.
"""

from __future__ import annotations

import importlib.metadata
import os
import runpy
import shutil
import sys
from pathlib import Path

from hf_optim import _startup
from hf_optim._autoimport import replace_namespace_package
from hf_optim.errors import suggest
from hf_optim.integrations.name_table import HF_OPTIM_OPTIMIZER_NAMES
from hf_optim.notices import one_line_warnings

HOOK_DIR = Path(__file__).resolve().parent / "_autoimport"
"""Put first on ``PYTHONPATH`` for child processes (see ``hf_optim/_autoimport/sitecustomize.py``)."""

USAGE = "usage: hf-optim run [-h] [--] COMMAND [ARG ...]    (also: python -m hf_optim.run COMMAND [ARG ...])"

DESCRIPTION = """\
Run COMMAND with hf_optim imported first, in this process and in every Python process it starts, so that its
--optim (or optim=) accepts hf_optim's names and transformers' bitsandbytes names build hf_optim's classes.

COMMAND is an installed console script (trl, accelerate, torchrun, ...), a Python file (train.py, also after
`python`), -m MODULE, or python -c CODE. Everything after it is passed on unchanged.

examples:
  hf-optim run -- trl sft --model_name_or_path MODEL --dataset_name DATA --optim lamb_8bit --output_dir out
  hf-optim run -- trl sft --help                       # --optim's choices include hf_optim's names
  hf-optim run -- accelerate launch --config_file recipes/accelerate/fsdp2.yaml train.py --optim paged_adamw_8bit
  hf-optim run -- torchrun --nproc_per_node 2 train.py
  accelerate launch -m hf_optim.run train.py           # the launcher as accelerate's module
  accelerate launch -m hf_optim.run -m trl.scripts.sft --optim lamb_8bit ...
"""


class CommandNotFound(LookupError):
    """COMMAND is neither a console script, nor a Python file, nor ``-m MODULE``."""


def help_text() -> str:
    names = ", ".join(HF_OPTIM_OPTIMIZER_NAMES)  # read without importing torch: --help answers at once
    return f"{USAGE}\n\n{DESCRIPTION}\nhf_optim's optim names (`hf-optim optimizers` for their classes):\n  {names}\n"


def export_to_child_processes(environ: dict | None = None) -> None:
    """Make Python processes started from now on import hf_optim at start-up (``PYTHONPATH`` gets the hook first)."""
    environ = os.environ if environ is None else environ
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != HOOK_DIR]
    environ["PYTHONPATH"] = os.pathsep.join([str(HOOK_DIR), *parts])


def _console_script(name: str) -> importlib.metadata.EntryPoint | None:
    return next(iter(importlib.metadata.entry_points(group="console_scripts", name=name)), None)


def _python_file(path: str | None) -> bool:
    """True for a file that is Python source: ``*.py``, or an executable whose first line names python."""
    if not path or not os.path.isfile(path):
        return False
    if path.endswith(".py"):
        return True
    with open(path, "rb") as f:
        first = f.readline(200)
    return first.startswith(b"#!") and b"python" in first


def _is_python(word: str) -> bool:
    name = os.path.basename(word)
    return name in ("python", "python3", os.path.basename(sys.executable)) or (
        name.startswith("python3.") and name[8:].isdigit())


def resolve(command: list[str]):
    """(kind, target, argv) for ``command``: kind is ``"entry_point"`` (target: an EntryPoint), ``"module"``
    (target: a module name), ``"file"`` (target: a path) or ``"code"`` (``python -c``: target is the code); argv
    is what ``sys.argv`` must be.

    Raises:
        CommandNotFound: naming the command and the closest console scripts.
    """
    first, rest = command[0], command[1:]
    if _is_python(first):  # `python train.py ...` / `python -m pkg.mod ...`: this interpreter runs it
        if rest[:1] == ["-c"] and len(rest) > 1:
            return "code", rest[1], ["-c", *rest[2:]]
        if not rest or (rest[0].startswith("-") and rest[0] != "-m"):
            got = " ".join(rest) or "nothing"
            raise CommandNotFound(f"`{first}` takes a Python file, -m MODULE or -c CODE here (got {got})")
        first, rest = rest[0], rest[1:]
    if first == "-m":
        if not rest:
            raise CommandNotFound("-m needs a module name, e.g. -m trl.scripts.sft")
        return "module", rest[0], [rest[0], *rest[1:]]
    if os.sep in first or first.endswith(".py"):
        if not _python_file(first):
            raise CommandNotFound(f"{first!r} is not a Python file")
        return "file", first, [first, *rest]
    entry = _console_script(first)
    if entry is not None:
        return "entry_point", entry, [first, *rest]
    found = shutil.which(first)
    if _python_file(found):  # a script installed without an entry point (deepspeed's launcher, for one)
        return "file", found, [found, *rest]
    scripts = sorted({ep.name for ep in importlib.metadata.entry_points(group="console_scripts")})
    close = suggest(first, scripts)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise CommandNotFound(f"{first!r} is not an installed console script, a Python file or -m MODULE{hint}")


def _exit_code(result) -> int:
    """What a console script's wrapper (``sys.exit(main())``) makes of ``main()``'s return value."""
    if result is None:
        return 0
    if isinstance(result, int):
        return result
    print(result, file=sys.stderr)
    return 1


def run(command: list[str]) -> int:
    """Run ``command`` (a console script, a Python file, or ``-m MODULE``, each with its arguments) in this process,
    hf_optim imported and exported to the processes it starts. Returns its exit status (a ``SystemExit`` it raises
    propagates)."""
    kind, target, argv = resolve(command)
    shadowed = replace_namespace_package()  # `import hf_optim` found a folder named hf_optim on PYTHONPATH first
    if shadowed:
        print(shadowed, file=sys.stderr)
    _startup.finish()  # `import hf_optim` in full (in the hf-optim command it waits until the command is found)
    export_to_child_processes()
    one_line_warnings()  # as the processes it starts do (hf_optim/_autoimport/sitecustomize.py)
    sys.argv = argv
    if kind == "entry_point":
        return _exit_code(target.load()())
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return 0
    if kind == "code":
        sys.path.insert(0, "")  # as `python -c` puts the working directory first
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python FILE` puts the file's directory first
    runpy.run_path(target, run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``hf-optim run [--] COMMAND ...`` / ``python -m hf_optim.run COMMAND ...``; returns COMMAND's exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    elif args[:1] in (["-h"], ["--help"]):
        print(help_text())
        return 0
    if not args:
        print("hf-optim run: error: give the command to run, e.g. hf-optim run -- trl sft --optim lamb_8bit ... "
              "(see hf-optim run --help)", file=sys.stderr)
        return 2
    try:
        return run(args)
    except CommandNotFound as exc:
        print(f"hf-optim run: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
