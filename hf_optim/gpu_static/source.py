"""The kernel sources, read with ``ast``: which arm of each ``if`` and how many trips of each ``for`` a configuration
takes, and which of them an instruction's source lines lie in."""

from __future__ import annotations

import ast
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from hf_optim.gpu_static.sass import Instruction


@dataclass(frozen=True)
class Construct:
    """An ``if`` or a run-time ``for`` of a kernel source file."""

    kind: str  # "if" | "for"
    arms: tuple[tuple[int, int], ...]  # (first line, last line): if: body, else; for: body
    source: str  # if: the test; for: the iterable
    head: tuple[int, int]  # lines of the `if`/`elif` test or the `for` header


@functools.cache
def constructs(path: str) -> tuple[Construct, ...]:
    """Every ``if`` and run-time ``for`` (over ``range``: ``tl.static_range`` unrolls) in the functions of ``path``."""
    try:
        text = Path(path).read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError):
        return ()

    def span(statements) -> tuple[int, int]:
        return statements[0].lineno, max(statement.end_lineno for statement in statements)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            arms = (span(node.body),) + ((span(node.orelse),) if node.orelse else ())
            found.append(Construct("if", arms, ast.get_source_segment(text, node.test),
                                    (node.lineno, node.test.end_lineno)))
        elif (isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and isinstance(node.iter.func, ast.Name)
              and node.iter.func.id == "range"):
            found.append(Construct("for", (span(node.body),), ast.get_source_segment(text, node.iter),
                                    (node.lineno, node.iter.end_lineno)))
    return tuple(found)


@functools.cache
def _line_arms(path: str) -> dict[int, tuple[tuple[int, int], ...]]:
    """line -> (construct index, arm) of every construct arm of ``path`` that contains it."""
    lines: dict[int, list] = {}
    for index, construct in enumerate(constructs(path)):
        for arm, (first, last) in enumerate(construct.arms):
            for line in range(first, last + 1):
                lines.setdefault(line, []).append((index, arm))
    return {line: tuple(arms) for line, arms in lines.items()}


def arm_keys(ins: Instruction) -> set[tuple[str, int, int]]:
    """(file, construct index, arm) of every arm the instruction's inlining chain lies in."""
    return {(path, index, arm) for path, line in ins.frames for index, arm in _line_arms(path).get(line, ())}


def _module_namespace(path: str) -> dict:
    """The numeric globals of the loaded module at ``path`` (``tl.constexpr`` values unwrapped), for the tests."""
    if path not in _NAMESPACES:
        for module in list(sys.modules.values()):
            file = getattr(module, "__file__", None)
            if file and os.path.realpath(file) == os.path.realpath(path):
                values = {name: getattr(value, "value", value) for name, value in vars(module).items()}
                _NAMESPACES[path] = {k: v for k, v in values.items() if isinstance(v, int | float | bool)}
                break
        else:
            return {}  # not imported (yet): not remembered
    return _NAMESPACES[path]


_NAMESPACES: dict[str, dict] = {}


class Decisions:
    """What a configuration does at each ``if`` (the arm taken: 0 body, 1 else) and ``for`` (trips) of the sources.

    A test is evaluated on the configuration's ``names`` (compile-time constants and run-time facts, e.g. ``dtype``)
    over the module's numeric globals; ``names`` may also map a test's exact source text to its outcome. A test that
    reads anything else is undecided (None): a compile-time test of a helper's own parameter, which leaves no branch.
    """

    def __init__(self, names: dict):
        self.names = names
        self._cache: dict[tuple[str, int], int | None] = {}

    def __call__(self, path: str, index: int) -> int | None:
        key = (path, index)
        if key not in self._cache:
            self._cache[key] = self._decide(path, constructs(path)[index])
        return self._cache[key]

    def _decide(self, path: str, construct: Construct) -> int | None:
        if construct.source in self.names:
            outcome = self.names[construct.source]
        else:
            scope = {**_module_namespace(path), **self.names}
            try:
                outcome = eval(construct.source, {"__builtins__": {"range": range, "len": len}}, scope)  # noqa: S307
            except Exception:
                return None
        if construct.kind == "for":
            return len(outcome) if isinstance(outcome, range) else int(outcome)
        return 0 if outcome else 1

    def goes(self, key: tuple[str, int, int]) -> bool | None:
        """Whether the configuration runs code in arm ``key`` (None: undecided)."""
        path, index, arm = key
        outcome = self(path, index)
        if outcome is None:
            return None
        return outcome > 0 if constructs(path)[index].kind == "for" else outcome == arm

    def sign(self, ins: Instruction, context: frozenset = frozenset()) -> int:
        """-1 if the instruction lies in an arm the configuration does not run, +1 if in one it runs, else 0; arms of
        the constructs in ``context`` ((file, construct index) pairs) are left out."""
        verdicts = {self.goes(key) for key in arm_keys(ins) if key[:2] not in context}
        return -1 if False in verdicts else 1 if True in verdicts else 0


def tested_if(ins: Instruction) -> tuple[str, int] | None:
    """The ``if`` whose test line the branch instruction is attributed to (innermost frame first)."""
    for path, line in ins.frames:
        for index, construct in enumerate(constructs(path)):
            if construct.kind == "if" and construct.head[0] <= line <= construct.head[1]:
                return path, index
    return None


def loop_of(latch: Instruction) -> tuple[str, int] | None:
    """The source ``for`` a loop's backward branch belongs to: the one whose header line the branch is attributed to
    (innermost frame first); None for a loop of the compiler's or a library's own."""
    for path, line in latch.frames:
        for index, construct in enumerate(constructs(path)):
            if construct.kind == "for" and construct.head[0] <= line <= construct.head[1]:
                return path, index
    return None
