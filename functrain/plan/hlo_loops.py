"""The loops of a compiled XLA program, read from its HLO text (``compiled.as_text()``), and the program with each
loop unrolled, so that XLA's cost analysis, which counts a loop body once, counts every iteration.

A loop's count is the one XLA annotated (``known_trip_count`` in its backend config: XLA:CPU writes it), else, as
in libtpu's programs, which annotate none, it is read from its induction variable: the condition
compares one element of the loop's tuple with a constant (``i < N``), the loop starts it at a constant (its init
tuple) and the body adds a constant to it (``i + s``), so the loop runs ``ceil((N - start) / s)`` times (libtpu's
collective-matmul loops step by 2; JAX's scans by 1). Where the start or the step is not a constant in the text
(a loop XLA peeled, whose counter is computed), the count is the condition's bound, less one for a loop whose
first iteration was peeled off (its condition's parameter is named ``loop_peel_cond_param``); a condition of
another form counts once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = ")
# An opcode: the first lower-case word followed by "(" (shapes hold only upper-case ones: T(8,128), S(1)).
_OPCODE = re.compile(r" ([a-z][a-z0-9_\-]*)\(")
_NAME = re.compile(r"%([\w.\-]+)")
_COMMENT = re.compile(r"/\*.*?\*/")
_PARENS = re.compile(r"[()]")
_CONSTANT = re.compile(r" constant\((-?\d+)\)")
# XLA's own count, where the compiler annotated it (XLA:CPU does; libtpu does not).
_KNOWN_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PARAMETER = re.compile(r" parameter\((\d+)\)")
# The computations an instruction calls (a loop's body is read from the loop itself).
_CALLED = re.compile(r"\b(?:calls|to_apply|branch_computations)=\{?([%\w.\-, ]+)\}?")
_WHILE = re.compile(
    r"^(\s*)(ROOT )?%([\w.\-]+) = (.*?) while\((%[\w.\-]+)\), condition=%?([\w.\-]+), body=%?([\w.\-]+)"
)
# Instructions a loop counter passes through unchanged in value.
_PASS_THROUGH = ("copy", "convert", "bitcast")
# A comparison with its operands swapped.
_SWAPPED = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
DTYPE_BYTES |= {"f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
# An array shape in a result: ``bf16[32768,768]{1,0:T(8,128)(2,1)}`` -> (bf16, 32768,768).
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


@dataclass(frozen=True)
class Instruction:
    """One instruction's line of HLO text, parsed on demand."""

    name: str
    line: str

    @cached_property
    def _call(self) -> tuple[str, list[str]]:
        start = self.line.index(" = ") + 2
        found = _OPCODE.search(self.line, start)
        if found is None:
            return "", []
        depth, end = 0, len(self.line)
        for paren in _PARENS.finditer(self.line, found.end() - 1):
            depth += 1 if paren.group() == "(" else -1
            if depth == 0:
                end = paren.start()
                break
        return found.group(1), _NAME.findall(_COMMENT.sub("", self.line[found.end() : end]))

    @property
    def opcode(self) -> str:
        """``add``, ``while``, ``get-tuple-element``, ..."""
        return self._call[0]

    @property
    def operands(self) -> list[str]:
        """The names of the instructions it reads, in order."""
        return self._call[1]

    def attribute(self, key: str) -> str | None:
        """The value of attribute ``key`` (``index=3`` -> ``"3"``; a computation's name without its ``%``)."""
        found = re.search(rf"\b{key}=%?([\w.\-]+)", self.line)
        return None if found is None else found.group(1)

    def result_arrays(self) -> list[tuple[str, list[int]]]:
        """The element type and dimensions of each array of its result (one, or a tuple's)."""
        start = self.line.index(" = ") + 2
        opcode = _OPCODE.search(self.line, start)
        found = _ARRAY.findall(self.line[start : opcode.start() if opcode else None])
        return [(dtype, [int(dim) for dim in dims.split(",") if dim]) for dtype, dims in found]

    def result_bytes(self, first_only: bool = False) -> int:
        """The bytes of its result: every array of a tuple, or its first (``first_only``)."""
        arrays = self.result_arrays()[: 1 if first_only else None]
        return sum(DTYPE_BYTES.get(dtype, 4) * math.prod(dims) for dtype, dims in arrays)

    def constant(self) -> int | None:
        """The value of an integer scalar constant; None for any other instruction."""
        found = _CONSTANT.search(self.line) if self.opcode == "constant" else None
        return None if found is None else int(found.group(1))


@dataclass
class Computation:
    """One computation of the program: its instructions by name and its root."""

    name: str
    peeled: bool  # a loop condition whose loop's first iteration XLA peeled off
    instructions: dict[str, Instruction] = field(default_factory=dict)
    root: str | None = None

    def through(self, name: str) -> Instruction | None:
        """The instruction ``name`` reads its value from, past copies and conversions."""
        instruction = self.instructions.get(name)
        while instruction is not None and instruction.opcode in _PASS_THROUGH and len(instruction.operands) == 1:
            instruction = self.instructions.get(instruction.operands[0])
        return instruction

    def element(self, instruction: Instruction | None) -> int | None:
        """The index of the computation's tuple parameter ``instruction`` reads, or None."""
        if instruction is None or instruction.opcode != "get-tuple-element":
            return None
        source = self.instructions.get(instruction.operands[0])
        index = instruction.attribute("index")
        return None if source is None or source.opcode != "parameter" or index is None else int(index)


@dataclass
class Program:
    """A compiled program's computations by name, and its entry computation's name."""

    computations: dict[str, Computation]
    entry: str | None

    def loops(self) -> list[tuple[Computation, Instruction]]:
        """Every ``while`` instruction, with the computation it is in."""
        return [
            (computation, instruction)
            for computation in self.computations.values()
            for instruction in computation.instructions.values()
            if " while(" in instruction.line and instruction.opcode == "while"
        ]

    def total(self, amount: Callable[[Computation, Instruction], float]) -> float:
        """``amount`` of each instruction the entry computation runs, summed: its own instructions' and those of
        the computations they call, a loop's body once per iteration (:meth:`trip_count`)."""
        totals: dict[str, float] = {}

        def of(name: str) -> float:
            computation = self.computations.get(name)
            if computation is None:
                return 0.0
            if name not in totals:
                totals[name] = 0.0  # a cycle (none in HLO) would count once
                totals[name] = sum(run(computation, instruction) for instruction in computation.instructions.values())
            return totals[name]

        def run(computation: Computation, instruction: Instruction) -> float:
            line = instruction.line
            if " while(" in line and instruction.opcode == "while":
                return self.trip_count(computation, instruction) * of(instruction.attribute("body") or "")
            called = [name.strip().lstrip("%") for group in _CALLED.findall(line) for name in group.split(",")]
            return amount(computation, instruction) + sum(of(name) for name in called if name)

        return of(self.entry) if self.entry else 0.0

    def trip_count(self, parent: Computation, loop: Instruction) -> int:
        """How many times ``loop`` (a ``while`` in ``parent``) runs its body: the count XLA annotated, else read
        from its induction variable (see the module)."""
        known = _KNOWN_TRIP_COUNT.search(loop.line)
        if known:
            return int(known.group(1))
        return self.induction_trip_count(parent, loop)

    def induction_trip_count(self, parent: Computation, loop: Instruction) -> int:
        """How many times ``loop`` runs its body, read from its induction variable (see the module)."""
        condition = self.computations.get(loop.attribute("condition") or "")
        body = self.computations.get(loop.attribute("body") or "")
        compare = self.operation(condition, condition.root or "") if condition is not None else None
        if condition is None or body is None or compare is None or compare[0] != "compare" or len(compare[1]) != 2:
            return 1
        direction = compare[2].attribute("direction") or ""
        counter, bound = (condition.through(name) for name in compare[1])
        if bound is None or bound.constant() is None:
            counter, bound, direction = bound, counter, _SWAPPED.get(direction, "")
        limit = None if bound is None else bound.constant()
        if limit is None:
            return 1
        index = condition.element(counter)
        start = None if index is None else _start(parent, loop, index)
        step = None if index is None else self._step(body, index)
        if start is None or step is None:
            return max(limit - condition.peeled, 1) if direction == "LT" else 1
        return _iterations(direction, start, limit, step)

    def operation(self, computation: Computation, name: str) -> tuple[str, list[str], Instruction] | None:
        """The operation instruction ``name`` computes: its opcode, its operands and the instruction that holds its
        attributes. A fusion of one operation (XLA:CPU wraps a loop's compare and add so) is that operation on the
        fusion's operands."""
        instruction = computation.through(name)
        if instruction is None or instruction.opcode != "fusion":
            return None if instruction is None else (instruction.opcode, instruction.operands, instruction)
        fused = self.computations.get(instruction.attribute("calls") or "")
        inner = fused.instructions.get(fused.root or "") if fused is not None else None
        if fused is None or inner is None:
            return None
        operands = []
        for operand in inner.operands:
            parameter = fused.through(operand)
            number = _PARAMETER.search(parameter.line) if parameter is not None else None
            if number is None or int(number.group(1)) >= len(instruction.operands):
                return None
            operands.append(instruction.operands[int(number.group(1))])
        return inner.opcode, operands, inner

    def _step(self, body: Computation, index: int) -> int | None:
        """The constant a loop's body adds to its counter (element ``index`` of its tuple), or None."""
        root = body.instructions.get(body.root or "")
        if root is None or root.opcode != "tuple" or index >= len(root.operands):
            return None
        update = self.operation(body, root.operands[index])
        if update is None or update[0] not in ("add", "subtract") or len(update[1]) != 2:
            return None
        left, right = (body.through(name) for name in update[1])
        if body.element(left) == index and right is not None and right.constant() is not None:
            return right.constant() if update[0] == "add" else -right.constant()  # type: ignore[operator]
        if update[0] == "add" and body.element(right) == index and left is not None:
            return left.constant()
        return None


def _start(parent: Computation, loop: Instruction, index: int) -> int | None:
    """The constant a loop's counter (element ``index`` of its tuple) starts at, or None."""
    init = parent.through(loop.operands[0]) if loop.operands else None
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    value = parent.through(init.operands[index])
    return None if value is None else value.constant()


def elements(dims: str) -> int:
    """The elements of an array of dimensions ``dims`` as HLO writes them (``"32768,768"``; ``""``: a scalar)."""
    count = 1
    for dim in filter(None, dims.split(",")):
        count *= int(dim)
    return count


def _iterations(direction: str, start: int, limit: int, step: int) -> int:
    """The iterations of ``for (i = start; i <direction> limit; i += step)``; 1 for a form not recognised."""
    if direction in ("LT", "LE") and step > 0:
        return max(-(-(limit + (direction == "LE") - start) // step), 0)
    if direction in ("GT", "GE") and step < 0:
        return max(-(-(start - limit + (direction == "GE")) // -step), 0)
    return 1


def parse_program(text: str) -> Program:
    """The computations of HLO text (``compiled.as_text()``); instructions are parsed when read."""
    computations: dict[str, Computation] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = Computation(header.group(2), "(loop_peel_cond_param:" in line)
            computations[current.name] = current
            entry = current.name if header.group(1) else entry
            continue
        found = _INSTRUCTION.match(line) if current is not None else None
        if found and current is not None:
            current.instructions[found.group(2)] = Instruction(found.group(2), line)
            if found.group(1):
                current.root = found.group(2)
    return Program(computations, entry)


def loops_unrolled(text: str, program: Program | None = None) -> str:
    """HLO text with each ``while`` replaced by its body called once per iteration, one call after another: the
    same program, which XLA's cost analysis then counts whole (the conditions, a comparison each, are left out).
    ``program``: the text already parsed."""
    program = program or parse_program(text)
    trips = {instruction.name: program.trip_count(parent, instruction) for parent, instruction in program.loops()}
    lines = []
    for line in text.splitlines():
        loop = _WHILE.match(line)
        if loop is None:
            lines.append(line)
            continue
        indent, root, name, shape, value, _, body = loop.groups()
        count = max(trips.get(name, 1), 1)  # a loop that never runs is counted once, as XLA counts it
        for turn in range(count):
            last = turn == count - 1
            target = name if last else f"{name}.turn{turn}"
            lines.append(f"{indent}{root if last and root else ''}%{target} = {shape} call({value}), to_apply=%{body}")
            value = f"%{target}"
    return "\n".join(lines)
