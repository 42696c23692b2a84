"""Reading XLA's text dumps: HLO instructions, their shapes and FLOPs, and buffer assignments.

Plain text parsing, no XLA needed: the same functions read the HLO torch_xla returns for
pending tensors (operands printed with their shapes) and the optimized HLO XLA dumps (operands
printed by name only; shapes come from each instruction's definition).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# `[ROOT] %name = <shape> opcode(`; the shape is `f32[16,<=8]{1,0:T(8,128)}` or a tuple `(...)`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+) = ")
_ARRAY_SHAPE = re.compile(r"\w+\[([\d,<=]*)\](?:\{[^}]*\})?")
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$", re.MULTILINE)
_TOTAL = re.compile(r"^Total bytes used: (\d+)", re.MULTILINE)
FLOP_OPCODES = ("dot", "convolution")


def count_instructions(hlo: str, opcode: str, *, reading: str | None = None) -> int:
    """How many instructions of ``opcode`` (``"dot"``, ``"opt-barrier"``, ...) ``hlo`` has.

    Only instruction definitions count, not the same word in metadata or attributes. With
    ``reading=``, only the instructions that read an output of a ``reading`` instruction,
    directly or through pure data movement (tuple access, copies, bitcasts, transposes,
    reshapes): ``count_instructions(hlo, "all-gather", reading="opt-barrier")`` counts the
    gathers of barriered values, in a checkpointed SPMD step the recomputation's re-gathers.
    """
    instructions = _instructions(hlo)
    if reading is None:
        return sum(1 for inst in instructions if inst.opcode == opcode)
    by_name = {inst.name: inst for inst in instructions}

    def reads_source(name: str) -> bool:
        inst = by_name.get(name)
        while inst is not None:
            if inst.opcode == reading:
                return True
            if inst.opcode not in _DATA_MOVEMENT or not inst.operands:
                return False
            inst = by_name.get(inst.operands[0])
        return False

    return sum(
        1
        for inst in instructions
        if inst.opcode == opcode and any(reads_source(name) for name in inst.operands)
    )


_DATA_MOVEMENT = frozenset({"get-tuple-element", "copy", "bitcast", "transpose", "reshape"})


@dataclass(frozen=True)
class _Instruction:
    name: str
    dims: tuple[int, ...]
    opcode: str
    operands: tuple[str, ...]
    attributes: str


def _closing(text: str, start: int) -> int:
    """Index of the bracket that closes the one opened at ``text[start]``."""
    depth = 0
    for index in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return index
    return len(text) - 1


def _split_top_level(text: str) -> list[str]:
    """Split an operand list at the commas that are not inside a shape or a layout."""
    pieces, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            pieces.append(text[start:index])
            start = index + 1
    pieces.append(text[start:])
    return pieces


def _instructions(hlo: str) -> list[_Instruction]:
    found = []
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        rest = line[match.end() :]
        dims: tuple[int, ...] = ()
        if rest.startswith("("):  # a tuple-shaped result: no dims of its own
            rest = rest[_closing(rest, 0) + 1 :].lstrip()
        else:
            shape = _ARRAY_SHAPE.match(rest)
            if shape is None:
                continue
            dims = tuple(int(d.lstrip("<=")) for d in shape.group(1).split(",") if d)
            rest = rest[shape.end() :].lstrip()
        opcode_match = re.match(r"([\w\-]+)\(", rest)
        if opcode_match is None:
            continue
        open_at = opcode_match.end() - 1
        close_at = _closing(rest, open_at)
        operands = tuple(
            "%" + piece.split()[-1].lstrip("%")
            for piece in _split_top_level(rest[open_at + 1 : close_at])
            if piece.strip()
        )
        name = match.group(1) if match.group(1).startswith("%") else "%" + match.group(1)
        found.append(
            _Instruction(name, dims, opcode_match.group(1), operands, rest[close_at + 1 :])
        )
    return found


def flops(hlo: str) -> int:
    """Floating-point operations of the dots and convolutions in ``hlo`` (2 per multiply-add).

    Elementwise work is left out: it is small next to matmuls and convolutions, and it is what
    XLA fuses differently from run to run. Matmuls a backend rewrote into custom calls (cuBLAS,
    oneDNN) are not seen, and a dot inside a loop body counts once.
    """
    instructions = _instructions(hlo)
    dims = {i.name: i.dims for i in instructions}
    total = 0
    for inst in instructions:
        if inst.opcode not in FLOP_OPCODES or len(inst.operands) < 2:
            continue
        out = math.prod(inst.dims)
        lhs, rhs = (dims.get(o) for o in inst.operands[:2])
        if inst.opcode == "dot" and lhs is not None:
            match = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attributes)
            contracted = [int(d) for d in match.group(1).split(",") if d] if match else []
            total += 2 * out * math.prod(lhs[d] for d in contracted)
        elif inst.opcode == "convolution" and rhs is not None:
            match = re.search(r"dim_labels=\w+_(\w+)->", inst.attributes)
            if match is None or len(match.group(1)) != len(rhs):
                continue
            kernel = match.group(1)
            total += 2 * out * math.prod(rhs) // rhs[kernel.index("o")]
    return total


@dataclass(frozen=True)
class BufferAssignment:
    """XLA's buffer assignment of one compiled program, in bytes.

    ``total`` is the program's peak device memory: every allocation after liveness-based
    packing. It splits into the program's arguments (parameters, donated or not), its outputs,
    and temporaries (everything else, mostly one packed preallocated block).
    """

    total: int
    arguments: int
    outputs: int
    temporaries: int


def parse_buffer_assignment(text: str) -> BufferAssignment | None:
    """Read a ``*buffer-assignment.txt`` dump; None if it has no total."""
    total = _TOTAL.search(text)
    if total is None:
        return None
    arguments = outputs = temporaries = 0
    for size, attributes in _ALLOCATION.findall(text):
        if re.search(r"\bparameter \d+", attributes):
            arguments += int(size)
        elif "maybe-live-out" in attributes or "output shape" in attributes:
            outputs += int(size)
        else:
            temporaries += int(size)
    return BufferAssignment(int(total.group(1)), arguments, outputs, temporaries)
