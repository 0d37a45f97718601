"""The main path through a kernel for a configuration: what a thread executes in the common case (a full tile, the
configuration's parameter dtype and state format, no special operands).

The cubin is disassembled with source lines and inlining (``nvdisasm -gi``) and split into basic blocks (labels,
branches, exits), with their immediate post-dominators (:mod:`hf_optim.gpu_static.sass`). Every ``if`` and ``for`` of
the kernel sources (read with ``ast``: :mod:`hf_optim.gpu_static.source`) is decided for the configuration: its test
is evaluated on the configuration's compile-time constants and run-time facts (e.g. ``dtype == 1`` with the
parameter's dtype code, ``fmt == FORMAT_BLOCKWISE8`` with the state format's code, the full-tile test with a large
``n``), and a ``for`` over ``range(...)`` gets its trip count the same way. The walk starts at the entry and follows
unconditional branches. At a forward conditional branch, each side is the set of blocks reachable from it before the
branch's post-dominator and not from the other side, and these rules are tried in order:

1. a side whose code lies only in arms the configuration does not run is not taken, if the other side holds code
   it runs (the ``if``s the branch itself lies in are left out: the compiler shares code between their copies, and
   the line information then names one copy);
2. the ``if`` whose test line the branch is attributed to: the side holding the arm taken;
3. a decided ``if`` whose arms split the two sides (their majority arms differ): the side of the arm taken;
4. a side calling a compiler subroutine (the slow paths of IEEE division and square root for special operands,
   64-bit integer division when the operands do not fit 32 bits) or taken by a diverged warp is not taken;
5. the only side holding code the configuration runs;
6. a guard (one side skips to the join): the side with the code, which a warp issues when any of its threads
   runs it.

A branch no rule decides follows its larger side (an upper bound) and is counted in ``ambiguous_branches``
(marked ``?`` in the table); the CI test asserts there are none in the fused kernels. A backward branch attributed
to a ``for`` header is that loop's latch, taken trip count - 1 times; a loop whose body ends in an unconditional
backward branch leaves at its exit test (the branch attributed to the same header) once the body ran trip count
times; a compiler or library loop runs once and counts as ambiguous. Predicated instructions count where they lie on
the path: they issue whatever their predicate. The method is checked on kernels with known answers
(tests/gpu_static_probe.py: the arm of a run-time branch, loop trips, a spill).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

from hf_optim.gpu_static.control_flow import Sass
from hf_optim.gpu_static.sass import Instruction
from hf_optim.gpu_static.source import Decisions, arm_keys, constructs, loop_of, tested_if


@dataclass
class MainPath:
    instructions: int
    """Instructions executed per thread."""
    ambiguous: int
    """Branches no rule decided (the larger side was followed)."""
    blocks: list[int]
    """Blocks walked, in order."""
    rules: collections.Counter = field(default_factory=collections.Counter)
    """How many branches each rule decided (test, split, rare, evidence, loop, ambiguous)."""


def _by_construct(sass: Sass, region: frozenset[int]) -> dict[tuple[str, int], list[int]]:
    counts: dict[tuple[str, int], list[int]] = {}
    for b in region:
        for (path, index, arm), n in sass.arms[b].items():
            counts.setdefault((path, index), [0, 0])[arm] += n
    return counts


def _majority(counts: Sequence[int] | None) -> int | None:
    return None if not counts or not sum(counts) else int(counts[1] > counts[0])


@dataclass
class _Sides:
    """The two sides of a forward conditional branch, as the rules of :func:`_choose` read them."""

    successors: list[int]
    regions: list[frozenset[int]]
    """What each side runs that the other does not."""
    counts: list[dict[tuple[str, int], list[int]]]
    """Per side: instructions per arm of each construct."""
    context: frozenset
    """The constructs the branch lies in: code of their other arms on either side was shared by the compiler between
    both copies (its line information names one of them), so they say nothing here."""
    signs: list[set[int]]
    """Per side: :meth:`Decisions.sign` of its instructions."""
    possible: list[int]
    """The successors not excluded by rule 1 (a side holding only code the configuration does not run)."""

    def by_arm(self, key: tuple[str, int], outcome: int) -> int | None:
        """The only side holding the arm taken of ``if`` ``key``, else the only side without the arm not taken
        (an `if` without `else`, skipped), else the side where the arm taken is the majority."""
        sides = [c.get(key, [0, 0]) for c in self.counts]
        for found in ([side[outcome] > 0 for side in sides], [side[1 - outcome] == 0 for side in sides]):
            if found.count(True) == 1:
                return self.successors[found.index(True)]
        majority = [_majority(side) for side in sides]
        if majority[0] != majority[1] and outcome in majority:
            return self.successors[majority.index(outcome)]
        return None


def _sides(sass: Sass, decisions: Decisions, branch: int, stop: int | None) -> _Sides:
    successors = sass.blocks[branch].successors
    both = [sass.region(s, stop) for s in successors]
    regions = [both[0] - both[1], both[1] - both[0]]
    counts = [_by_construct(sass, region) for region in regions]
    context = frozenset(key[:2] for key in arm_keys(sass.blocks[branch].instructions[-1]))
    signs = [{decisions.sign(ins, context) for b in region for ins in sass.blocks[b].instructions}
             for region in regions]
    possible = [s for s, found in zip(successors, signs, strict=True) if not (-1 in found and 1 not in found)]
    return _Sides(successors, regions, counts, context, signs, possible)


def _choose(sass: Sass, decisions: Decisions, branch: int, stop: int | None) -> tuple[int | None, str]:
    """(the successor the configuration takes at the forward conditional branch ending block ``branch`` or None,
    the rule that decided)."""
    sides = _sides(sass, decisions, branch, stop)
    # 1. A side holding only code the configuration does not run (an arm not taken, a loop that does not run) is
    #    not taken, when the other side holds code it runs.
    if len(sides.possible) == 1 and any(1 in found for found in sides.signs):
        return sides.possible[0], "evidence"
    return _by_source(sides, decisions, sass.blocks[branch].instructions[-1]) or _by_shape(sass, sides)


def _by_source(sides: _Sides, decisions: Decisions, branch: Instruction) -> tuple[int, str] | None:
    """Rules 2 and 3 of :func:`_choose`: the ``if`` tests of the kernel sources decide."""
    # 2. The `if` whose test the branch is attributed to: the side holding the arm the configuration takes.
    tested = tested_if(branch)
    if tested is not None and decisions(*tested) is not None:
        chosen = sides.by_arm(tested, decisions(*tested))
        if chosen is not None:
            return chosen, "test"

    # 3. Else a decided `if` (not one the branch lies in) whose arms split the two sides (their majority arms
    #    differ), the one with the most instructions there.
    best, best_weight = None, 0
    for key in set(sides.counts[0]) | set(sides.counts[1]):
        outcome = decisions(*key)
        if outcome is None or constructs(key[0])[key[1]].kind != "if" or key in sides.context:
            continue
        counts = [c.get(key, [0, 0]) for c in sides.counts]
        majority = [_majority(side) for side in counts]
        weight = sum(map(sum, counts))
        if majority[0] != majority[1] and weight > best_weight:
            best, best_weight = key, weight
    if best is not None:
        chosen = sides.by_arm(best, decisions(*best))
        if chosen is not None:
            return chosen, "split"
    return None


def _by_shape(sass: Sass, sides: _Sides) -> tuple[int | None, str]:
    """Rules 4 to 6 of :func:`_choose`: what the sides hold decides (or nothing does: ``ambiguous``)."""
    # 4. A slow path (or a diverged warp) is not the main path.
    common = [s for s, region in zip(sides.successors, sides.regions, strict=True)
              if not any(sass.rare[b] for b in region)]
    if len(common) == 1:
        return common[0], "rare"

    # 5. The side holding code the configuration runs (e.g. a loop body that runs, against the guard that skips it).
    running = [s for s, found in zip(sides.successors, sides.signs, strict=True) if 1 in found and s in sides.possible]
    if len(running) == 1:
        return running[0], "evidence"

    # 6. A guard (one side skips straight to the join): the side with the code, which a warp issues when any of
    #    its threads runs it (e.g. a load under a mask that a full tile never clears).
    sized = [s for s, region in zip(sides.successors, sides.regions, strict=True) if region]
    if len(sized) == 1:
        return sized[0], "guard"
    return None, "ambiguous"


def _top_tested_loops(sass: Sass) -> dict[int, tuple[int, int, tuple[str, int] | None]]:
    """Loops whose body ends with an unconditional backward branch: their exit tests, as {block ending in the exit
    test: (loop header, the loop's last block, source ``for``)}. The exit test is the conditional branch in the loop,
    attributed to the same ``for`` header, with one side leaving the loop."""
    exits = {}
    for latch, block in enumerate(sass.blocks):
        if len(block.successors) != 1 or sass.blocks[block.successors[0]].start > block.start:
            continue
        header = block.successors[0]
        loop = loop_of(block.instructions[-1])
        for b in range(header, latch + 1):
            successors = sass.blocks[b].successors
            if (len(successors) == 2 and loop_of(sass.blocks[b].instructions[-1]) == loop
                    and sum(not header <= s <= latch for s in successors) == 1):
                exits[b] = (header, latch, loop)
    return exits


def main_path(sass: Sass, names: dict, limit: int = 10_000_000) -> MainPath:
    """The main path through the kernel for a configuration whose tests see ``names`` (see the module docstring).

    Args:
        sass: the binary's :func:`read_sass`.
        names: compile-time constants and run-time facts of the configuration.
        limit (default 10M): most instructions walked (a guard against a loop that never ends).
    """
    decisions = Decisions(names)
    blocks = sass.blocks
    exit_tests = _top_tested_loops(sass)
    count, ambiguous, walked, latch_taken, rules = 0, 0, [], {}, collections.Counter()
    headers = {header for header, _, _ in exit_tests.values()}
    visits: dict[int, int] = {}  # header of a loop ending in an unconditional branch -> arrivals since it was entered
    current: int | None = 0

    def trips_of(loop: tuple[str, int] | None) -> int:
        nonlocal ambiguous
        rules["loop"] += 1
        trips = decisions(*loop) if loop is not None else None
        if trips is None:  # a loop of the compiler's, or an undecided one: the body once
            ambiguous += 1
            return 1
        return trips

    while current is not None:
        block = blocks[current]
        walked.append(current)
        count += len(block.instructions)
        if current in headers:
            visits[current] = visits.get(current, 0) + 1
        if count > limit:
            raise RuntimeError(f"main path longer than {limit} instructions: a loop without a known trip count")
        if len(block.successors) <= 1:
            current = block.successors[0] if block.successors else None
            continue
        target, fallthrough = block.successors
        if current in exit_tests:  # the exit test of such a loop: leave once the body ran trips times
            header, latch, loop = exit_tests[current]
            inside, outside = sorted(block.successors, key=lambda s: not header <= s <= latch)
            runs = visits.get(header, 0) - (current == header)  # a test in the header runs before the body
            if runs < trips_of(loop):
                current = inside
            else:
                visits[header], current = 0, outside
            continue
        if blocks[target].start <= block.start:  # a loop's latch at the bottom: taken trips - 1 times
            trips = trips_of(loop_of(block.instructions[-1]))
            done = latch_taken.get(current, 0)
            if done + 1 < trips:
                latch_taken[current], current = done + 1, target
            else:
                latch_taken[current], current = 0, fallthrough
            continue
        current, rule = _follow(sass, decisions, current)
        rules[rule] += 1
        ambiguous += int(rule == "ambiguous")
    return MainPath(count, ambiguous, walked, rules)


def _follow(sass: Sass, decisions: Decisions, branch: int) -> tuple[int, str]:
    """(the successor the walk takes at the forward conditional branch ending block ``branch``, the rule that
    decided): :func:`_choose`'s, or where no rule decides (``ambiguous``) the larger side, an upper bound."""
    chosen, rule = _choose(sass, decisions, branch, sass.ipdom[branch])
    if chosen is None:
        successors = sass.blocks[branch].successors
        regions = {s: sass.region(s, sass.ipdom[branch]) for s in successors}
        chosen = max(successors, key=lambda s: sum(len(sass.blocks[b].instructions) for b in regions[s]))
    return chosen, rule
