"""A cubin's machine code: its instructions with their source lines (``nvdisasm -c -gi``), its basic blocks and their
immediate post-dominators. Nothing here knows the kernel sources (:mod:`hf_optim.gpu_static.source`) or a
configuration (:mod:`hf_optim.gpu_static.main_path`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hf_optim.gpu_static.compiling import run_tool


@dataclass
class Instruction:
    address: int
    predicate: str
    opcode: str
    text: str
    frames: tuple[tuple[str, int], ...]
    """Source (file, line) of the instruction, innermost inlined function first."""

    @property
    def target(self) -> str | None:
        found = re.search(r"`\(([^)]+)\)", self.text)
        return found.group(1) if found else None


_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^([.$\w][^\s:]*):")
_FRAME = re.compile(r'//## File "([^"]+)", line (\d+)')


def disassemble(cubin: bytes) -> tuple[list[Instruction], dict[str, int]]:
    """The kernel's instructions (``nvdisasm -c -gi``) and its labels (label -> index of the next instruction)."""
    instructions: list[Instruction] = []
    labels: dict[str, int] = {}
    frames: tuple = ()
    group: list = []
    in_comment = False
    for line in run_tool("nvdisasm", cubin, "-c", "-gi").splitlines():
        frame = _FRAME.search(line)
        if frame:
            if not in_comment:
                group = []
            group.append((frame.group(1), int(frame.group(2))))
            in_comment = True
            continue
        if in_comment:
            frames, in_comment = tuple(group), False
        found = _INSTRUCTION.match(line)
        if found:
            text = found.group(2).strip("{} ")
            predicate = ""
            if text.startswith("@"):
                predicate, text = text.split(None, 1)
            opcode = text.split(None, 1)[0]
            instructions.append(Instruction(int(found.group(1), 16), predicate, opcode, text, frames))
            continue
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(instructions)
    return instructions, labels


def _is_branch(ins: Instruction) -> bool:
    """A jump; ptxas also jumps with a call to a label of the same function (``@P0 CALL.REL.NOINC `(.L_x_0)``, a
    loop's exit on sm_80), unlike a call of a subroutine (``$__internal_...``)."""
    base = ins.opcode.split(".")[0]
    return base in ("BRA", "BRX", "JMP", "JMX") or (base == "CALL" and not (ins.target or "$").startswith("$"))


def _ends_block(ins: Instruction) -> bool:
    base = ins.opcode.split(".")[0]
    return _is_branch(ins) or base in ("RET", "EXIT", "KILL")


@dataclass
class Block:
    start: int
    instructions: list[Instruction]
    successors: list[int] = field(default_factory=list)
    """Block indices: [target, fallthrough] for a conditional branch."""


def basic_blocks(instructions: list[Instruction], labels: dict[str, int]) -> list[Block]:
    """The kernel function's basic blocks (subroutines after it are left out; a call is not a block end)."""
    end = min([index for name, index in labels.items() if name.startswith("$")] + [len(instructions)])
    leaders = {0}
    leaders.update(index for index in labels.values() if index < end)
    for index, ins in enumerate(instructions[:end]):
        if _ends_block(ins) and index + 1 < end:
            leaders.add(index + 1)
    starts = sorted(leaders)
    blocks = [Block(s, instructions[s:e]) for s, e in zip(starts, starts[1:] + [end], strict=True)]
    index_of = {block.start: i for i, block in enumerate(blocks)}
    for i, block in enumerate(blocks):
        last = block.instructions[-1]
        following = [i + 1] if i + 1 < len(blocks) else []
        base = last.opcode.split(".")[0]
        if _is_branch(last):
            target = labels.get(last.target or "")
            targets = [index_of[target]] if target in index_of else []
            unconditional = not last.predicate and ".DIV" not in last.opcode
            block.successors = targets if unconditional else targets + following
        elif base in ("RET", "EXIT", "KILL") and not last.predicate:
            block.successors = []
        else:
            block.successors = following
    return blocks


def post_dominators(blocks: list[Block]) -> list[int | None]:
    """Immediate post-dominator of each block (None: the exit)."""
    n = len(blocks)
    everyone = (1 << (n + 1)) - 1
    exit_bit = 1 << n
    pdom = [everyone] * n
    changed = True
    while changed:
        changed = False
        for i in reversed(range(n)):
            succs = blocks[i].successors
            meet = exit_bit if not succs else everyone
            for s in succs:
                meet &= pdom[s]
            new = meet | (1 << i)
            if new != pdom[i]:
                pdom[i], changed = new, True
    result: list[int | None] = []
    for i in range(n):
        strict = pdom[i] & ~(1 << i) & ~exit_bit
        candidates = [j for j in range(n) if strict >> j & 1]
        # the immediate one is post-dominated by all the others: the one with the most post-dominators
        result.append(max(candidates, key=lambda j: bin(pdom[j]).count("1")) if candidates else None)
    return result
