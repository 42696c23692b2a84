"""Reading XLA's text dumps: HLO instructions, their shapes and FLOPs, and buffer assignments.

Plain text parsing, no XLA needed: the same functions read the HLO torch_xla returns for
pending tensors (operands printed with their shapes) and the optimized HLO XLA dumps (operands
printed by name only; shapes come from each instruction's definition).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .._support.checks import check_text

# `[ROOT] %name = <shape> opcode(`; the shape is `f32[16,<=8]{1,0:T(8,128)}` or a tuple `(...)`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+) = ")
_ARRAY_SHAPE = re.compile(r"\w+\[([\d,<=]*)\](?:\{[^}]*\})?")
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$", re.MULTILINE)
_TOTAL = re.compile(r"^Total bytes used: (\d+)", re.MULTILINE)
FLOP_OPCODES = ("dot", "convolution")


def count_instructions(hlo: str, opcode: str, *, reading: str | None = None) -> int:
    """How many instructions of `opcode` (`"dot"`, `"opt-barrier"`, ...) `hlo` has.

    Only instruction definitions count, not the same word in metadata or attributes. With
    `reading=`, only the instructions that read an output of a `reading` instruction,
    directly or through pure data movement (tuple access, copies, bitcasts, transposes,
    reshapes): `count_instructions(hlo, "all-gather", reading="opt-barrier")` counts the
    gathers of barriered values, in a checkpointed SPMD step the recomputation's re-gathers.

    Args:
        hlo: HLO text (optimized or not, a whole module or a fragment of instructions).
        opcode: The opcode to count, as XLA spells it.
        reading: Another opcode; when given, only instructions that read its output
            count. `None` (the default) counts them all.

    Returns:
        The number of such instructions.

    Raises:
        CheckpointTypeError: If `hlo`, `opcode` or `reading` is not a string.

    Examples:
        >>> from xla_wrap import introspect
        >>> hlo = '''
        ... %p = (f32[8,16]{1,0}, f32[16,4]{1,0}) parameter(0)
        ... %t = (f32[8,16]{1,0}, f32[16,4]{1,0}) opt-barrier(%p)
        ... %a = f32[8,16]{1,0} get-tuple-element(%t), index=0
        ... %b = f32[16,4]{1,0} get-tuple-element(%p), index=1
        ... %d.1 = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
        ... %c = f32[8,16]{1,0} get-tuple-element(%p), index=0
        ... %d.2 = f32[8,4]{1,0} dot(%c, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
        ... '''
        >>> introspect.count_instructions(hlo, "dot")
        2
        >>> introspect.count_instructions(hlo, "dot", reading="opt-barrier")
        1
    """
    api = "xla_wrap.introspect.count_instructions"
    check_text(api, "hlo", hlo)
    check_text(api, "opcode", opcode)
    if reading is not None:
        check_text(api, "reading", reading)
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
    """Index of the bracket that closes the one opened at `text[start]`."""
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
    """Floating-point operations of the dots and convolutions in `hlo` (2 per multiply-add),
    as executed: a While loop's body counts once per iteration where XLA knows the trip count
    (`known_trip_count`, which it annotates on the optimized HLO), else once.

    Elementwise work is left out: it is small next to matmuls and convolutions, and it is what
    XLA fuses differently from run to run. Matmuls a backend rewrote into custom calls (cuBLAS,
    oneDNN) are not seen.
    """
    instructions = _instructions(hlo)
    dims = {i.name: i.dims for i in instructions}
    computations = _computations(hlo)
    if not computations:  # a fragment without computation headers: every dot once
        return sum(_dot_flops(inst, dims) for inst in instructions)
    by_name = {name: body for name, body, _ in computations}
    memo: dict[str, int] = {}

    def of(name: str) -> int:
        if name not in memo:
            memo[name] = 0  # a (never seen) cycle counts nothing
            total = 0
            for inst in _instructions(by_name.get(name, "")):
                total += _dot_flops(inst, dims)
                called = re.findall(
                    r"(?:calls|to_apply|condition|body)=(%[\w.\-]+)", inst.attributes
                )
                branches = re.findall(
                    r"%[\w.\-]+", _attribute(inst.attributes, "branch_computations")
                )
                branches += re.findall(r"(?:true|false)_computation=(%[\w.\-]+)", inst.attributes)
                inner = sum(of(c) for c in called)
                if inst.opcode == "while":
                    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attributes)
                    inner *= int(trips.group(1)) if trips else 1
                total += inner + max((of(b) for b in branches), default=0)
            memo[name] = total
        return memo[name]

    entry = next((name for name, _, is_entry in computations if is_entry), computations[-1][0])
    return of(entry)


def _attribute(attributes: str, key: str) -> str:
    match = re.search(key + r"=\{([^}]*)\}", attributes)
    return match.group(1) if match else ""


# `[ENTRY] %name (params) -> shape {` opens a computation; a line `}` closes it.
_COMPUTATION = re.compile(r"^(ENTRY\s+)?(%[\w.\-]+)\s*\(.*\{\s*$")


def _computations(hlo: str) -> list[tuple[str, str, bool]]:
    """(name, body text, is the entry) per computation of a module's text."""
    found: list[tuple[str, str, bool]] = []
    current: tuple[str, bool] | None = None
    lines: list[str] = []
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None and current is None:
            current, lines = (header.group(2), bool(header.group(1))), []
        elif current is not None and line.strip() == "}":
            found.append((current[0], "\n".join(lines), current[1]))
            current = None
        elif current is not None:
            lines.append(line)
    return found


def _dot_flops(inst: _Instruction, dims: dict[str, tuple[int, ...]]) -> int:
    if inst.opcode not in FLOP_OPCODES or len(inst.operands) < 2:
        return 0
    out = math.prod(inst.dims)
    lhs, rhs = (dims.get(o) for o in inst.operands[:2])
    if inst.opcode == "dot" and lhs is not None:
        match = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attributes)
        contracted = [int(d) for d in match.group(1).split(",") if d] if match else []
        return 2 * out * math.prod(lhs[d] for d in contracted)
    if inst.opcode == "convolution" and rhs is not None:
        match = re.search(r"dim_labels=\w+_(\w+)->", inst.attributes)
        if match is None or len(match.group(1)) != len(rhs):
            return 0
        kernel = match.group(1)
        return 2 * out * math.prod(rhs) // rhs[kernel.index("o")]
    return 0


@dataclass(frozen=True)
class BufferAssignment:
    """XLA's buffer assignment of one compiled program, in bytes.

    `total` is the program's peak device memory: every allocation after liveness-based
    packing. It splits into the program's arguments (parameters, donated or not), its outputs,
    and temporaries (everything else, mostly one packed preallocated block).
    """

    total: int
    arguments: int
    outputs: int
    temporaries: int


def parse_buffer_assignment(text: str) -> BufferAssignment | None:
    """Read a `*buffer-assignment.txt` dump; None if it has no total."""
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
