"""Reading XLA's text dumps: HLO instructions, their shapes and FLOPs, and buffer assignments.

Plain text parsing, no XLA needed: the same functions read the HLO torch_xla returns for
pending tensors (operands printed with their shapes) and the optimized HLO XLA dumps (operands
printed by name only; shapes come from each instruction's definition).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# `%name = f32[16,256]{1,0} opcode(` ; tuple-shaped results start with "(" and are skipped.
_DEFINITION = re.compile(r"(%[\w.\-]+) = (\w+)\[([\d,]*)\](?:\{[^}]*\})? ([\w\-]+)\(")
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$", re.MULTILINE)
_TOTAL = re.compile(r"^Total bytes used: (\d+)", re.MULTILINE)
FLOP_OPCODES = ("dot", "convolution")


def count_instructions(hlo: str, opcode: str) -> int:
    """How many instructions of ``opcode`` (``"dot"``, ``"opt-barrier"``, ...) ``hlo`` has."""
    return len(re.findall(rf"\s{re.escape(opcode)}\(", hlo))


@dataclass(frozen=True)
class _Instruction:
    name: str
    dims: tuple[int, ...]
    opcode: str
    operands: tuple[str, ...]
    attributes: str


def _instructions(hlo: str) -> list[_Instruction]:
    found = []
    for line in hlo.splitlines():
        match = _DEFINITION.search(line)
        if match is None:
            continue
        name, _, dims, opcode = match.groups()
        rest = line[match.end() :]
        depth, end = 1, 0
        for end, char in enumerate(rest):  # noqa: B007 - `end` is used after the loop
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        operands = tuple(re.findall(r"%[\w.\-]+", rest[:end]))
        shape = tuple(int(d) for d in dims.split(",") if d)
        found.append(_Instruction(name, shape, opcode, operands, rest[end + 1 :]))
    return found


def flops(hlo: str) -> int:
    """Floating-point operations of the dots and convolutions in ``hlo`` (2 per multiply-add).

    Elementwise work is left out: it is small next to matmuls and convolutions, and it is what
    XLA fuses differently from run to run.
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
