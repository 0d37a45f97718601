"""A binary's control flow as the main-path walk reads it: its basic blocks and post-dominators, and per block the
source arms its instructions lie in and whether it calls a slow path. Configuration-independent: read once per binary
(rows that share a binary share it)."""

from __future__ import annotations

import collections
import functools
import re
from dataclasses import dataclass, field

from hf_optim.gpu_static.sass import Block, Instruction, basic_blocks, disassemble, post_dominators
from hf_optim.gpu_static.source import arm_keys

_RARE = re.compile(r"^CALL\S*\s+`\(\$|^BRA\.DIV")
"""Calls of compiler subroutines (the slow paths of IEEE division and square root for special operands, 64-bit
integer division when the operands do not fit 32 bits) and branches taken only by diverged warps."""


@dataclass
class Sass:
    """A binary's disassembly and control flow (configuration-independent, cached per binary)."""

    instructions: list[Instruction]
    labels: dict[str, int]
    blocks: list[Block]
    ipdom: list[int | None]
    arms: list[collections.Counter] = field(default_factory=list)
    """Per block: instructions per (file, construct index, arm)."""
    rare: list[bool] = field(default_factory=list)
    _regions: dict = field(default_factory=dict)

    def region(self, start: int, stop: int | None) -> frozenset[int]:
        """Blocks reachable from ``start`` before ``stop`` (a branch's immediate post-dominator)."""
        key = (start, stop)
        if key not in self._regions:
            seen, todo = set(), [start]
            while todo:
                b = todo.pop()
                if b == stop or b in seen:
                    continue
                seen.add(b)
                todo.extend(self.blocks[b].successors)
            self._regions[key] = frozenset(seen)
        return self._regions[key]


@functools.lru_cache(maxsize=8)
def read_sass(cubin: bytes) -> Sass:
    """Disassemble ``cubin`` and build its control-flow graph (cached: rows sharing a binary read it once)."""
    instructions, labels = disassemble(cubin)
    blocks = basic_blocks(instructions, labels)
    sass = Sass(instructions, labels, blocks, post_dominators(blocks))
    for block in blocks:
        counter = collections.Counter()
        for ins in block.instructions:
            counter.update(arm_keys(ins))
        sass.arms.append(counter)
        sass.rare.append(any(_RARE.search(ins.text) for ins in block.instructions))
    return sass
