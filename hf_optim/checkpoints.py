"""Find the last COMPLETE Trainer checkpoint, so a run killed while saving resumes without corrupted state.

The Trainer writes ``checkpoint-N/`` in place (model, then optimizer.pt, scheduler.pt, rng_state*.pth, and
trainer_state.json last), and ``resume_from_checkpoint=True`` takes the highest N without looking inside
(``transformers.trainer_utils.get_last_checkpoint``). A process killed while writing ``checkpoint-N`` leaves a
folder that wins that comparison; resuming from it fails (transformers 5.23: ``FileNotFoundError`` for its
trainer_state.json, after loading its weights) until someone deletes it by hand.

:func:`last_complete_checkpoint` checks each checkpoint's files, newest first, and returns the first complete one:

    trainer.train(resume_from_checkpoint=hf_optim.last_complete_checkpoint(args.output_dir))

(None when there is none: the run starts from scratch, as ``resume_from_checkpoint=None``.)

Complete means: ``trainer_state.json`` (the Trainer's last write) parses and names step N; every ``.pt``,
``.pth`` and ``.bin`` file is a whole torch.save zip archive (its central directory, written last, is there);
every ``.safetensors`` file is as long as its header says; every ``.json`` parses; every torch.distributed.checkpoint
folder (FSDP's sharded model / optimizer state) has its ``.metadata`` file, which is written after all shards.
This guards against a killed process (data the process wrote survives in the page cache). It does not guard
against power loss before the operating system flushed the files: the Trainer does not fsync.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import zipfile
from pathlib import Path

logger = logging.getLogger("hf_optim")

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
DCP_METADATA = ".metadata"


def checkpoint_problems(path: str | os.PathLike) -> list[str]:
    """What makes the checkpoint directory ``path`` incomplete; an empty list when it is complete."""
    path = Path(path)
    problems = []
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        problems.append(f"{TRAINER_STATE} is missing (the Trainer writes it last)")
    else:
        match = CHECKPOINT_PATTERN.match(path.name)
        try:
            step = json.loads(state_file.read_text()).get("global_step")
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            problems.append(f"{TRAINER_STATE} is not valid JSON ({error})")
        else:
            if match and step != int(match.group(1)):
                problems.append(f"{TRAINER_STATE} says global_step={step}, the folder is {path.name}")
    for file in sorted(path.rglob("*")):
        if file.is_dir():
            if _is_dcp_folder(file) and not (file / DCP_METADATA).is_file():
                problems.append(f"{file.relative_to(path)}/ has shards but no {DCP_METADATA}")
            continue
        problem = _file_problem(file)
        if problem:
            problems.append(f"{file.relative_to(path)}: {problem}")
    return problems


def _is_dcp_folder(folder: Path) -> bool:
    return any(child.suffix == ".distcp" for child in folder.iterdir())


def _file_problem(file: Path) -> str | None:
    if file.name == DCP_METADATA or file.suffix == ".distcp":
        return None  # covered by the folder check
    if file.suffix in TORCH_SUFFIXES:
        if not zipfile.is_zipfile(file):
            return "not a complete torch.save archive (truncated?)"
    elif file.suffix == ".safetensors":
        return _safetensors_problem(file)
    elif file.suffix == ".json":
        try:
            json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "not valid JSON (truncated?)"
    return None


def _safetensors_problem(file: Path) -> str | None:
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return "truncated safetensors header"
        (header_size,) = struct.unpack("<Q", head)
        if 8 + header_size > size:
            return "truncated safetensors header"
        try:
            header = json.loads(handle.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "unreadable safetensors header"
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + header_size + end > size:
        return f"truncated safetensors data ({size} bytes, header needs {8 + header_size + end})"
    return None


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` folders of ``output_dir``, newest (highest N) first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        match = CHECKPOINT_PATTERN.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found, reverse=True)]


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete ``checkpoint-N`` folder of ``output_dir`` (see :func:`checkpoint_problems`), or None.

    Incomplete newer folders are skipped with a warning on the ``hf_optim`` logger naming what is wrong; they are
    left in place (the resumed run overwrites them when it saves that step again).
    """
    for path in checkpoints(output_dir):
        problems = checkpoint_problems(path)
        if not problems:
            return str(path)
        logger.warning("skipping incomplete checkpoint %s: %s", path, "; ".join(problems))
    return None
