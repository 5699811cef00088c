"""Reading an HLO module's text (`compiled.as_text()`): its computations, instructions and ops."""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
# a computation's first line: "[ENTRY ]%name (...) -> ... {"
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
# an array-shaped instruction: "[ROOT ]%name = type[dims]{layout} opcode(operands)"
_LINE = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*([a-z0-9]+)\[([0-9,]*)\]\S*\s+"
                   r"([\w\-]+)\(([^)]*)\)")
# any instruction's op name: "%name = type op-name(" (async pairs as op-start / op-done)
_OP = re.compile(r"=\s*\S.*?\s([a-z][a-z0-9-]*)\(")
_NAME = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """An array-shaped instruction: whether it is its computation's ROOT, its result's
    bytes, its opcode and the names of its operands."""

    root: bool
    nbytes: int
    opcode: str
    operands: tuple[str, ...]


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """The instruction lines of every computation in an HLO module's text, by name, and the
    name of its ENTRY computation."""
    blocks: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = blocks.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return blocks, entry


def split_entry(hlo: str) -> tuple[str, str]:
    """An HLO module's instructions as (its ENTRY computation's, every other computation's).
    A loop's ops sit in the others (its while body: once per step or round); those XLA
    hoisted out of the loop, or of a program without one, in ENTRY (once per call)."""
    blocks, entry = computations(hlo)
    return ("\n".join(blocks.get(entry, [])),
            "\n".join(line for name, lines in blocks.items() if name != entry
                      for line in lines))


def instructions(lines: list[str]) -> tuple[dict[str, Instruction], dict[str, int]]:
    """A computation's array-shaped instructions by name, and how often each name is read."""
    found: dict[str, Instruction] = {}
    reads: dict[str, int] = {}
    for line in lines:
        for name in _NAME.findall(line.partition("=")[2]):
            reads[name] = reads.get(name, 0) + 1
        m = _LINE.match(line)
        if m and m.group(3) in DTYPE_BYTES:
            size = DTYPE_BYTES[m.group(3)] * math.prod(
                int(d) for d in m.group(4).split(",") if d)
            found[m.group(2)] = Instruction(bool(m.group(1)), size, m.group(5),
                                            tuple(_NAME.findall(m.group(6))))
    return found, reads


def op_names(hlo: str) -> list[str]:
    """The op name of every instruction line, in order (an async pair's `-start` and
    `-done` as written)."""
    return [m.group(1) for line in hlo.splitlines() if (m := _OP.search(line))]
