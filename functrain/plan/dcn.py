"""The bytes each chip sends over the data-centre network (DCN) in one step, read from a compiled TPU program.

libtpu compiles a collective whose groups cross slices into host transfers run by its multi-slice ("Megascale")
runtime: a ``send`` per transfer, ``is_host_transfer=true``, whose frontend attributes name the collective
(``_xla_megascale_transfer_type``: ``ALL_REDUCE``, ``ALL_GATHER``, ``REDUCE_SCATTER``, ``ALL_TO_ALL``, ...). Its
operand is this chip's buffer; over ``k`` slices a ring moves (:data:`RING_FACTORS`) ``2 (k - 1) / k`` of it for an
all-reduce, ``k - 1`` times it for an all-gather (the chip's shard to every other slice), ``(k - 1) / k`` of it for
a reduce-scatter or an all-to-all, all of it for a point-to-point transfer.

A transfer inside a loop counts once per iteration. The compiled TPU program annotates no trip counts: a loop's
count is read from its condition, ``counter < N`` (JAX's scans count from 0; a loop whose first iteration XLA
peeled off runs ``N - 1`` more, its condition's parameter named ``loop_peel_cond_param``); a condition of another
form counts once.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# Bytes a ring sends per byte of a chip's buffer, for a transfer over ``k`` slices.
RING_FACTORS: dict[str, Callable[[int], float]] = {
    "ALL_REDUCE": lambda k: 2 * (k - 1) / k,
    "ALL_GATHER": lambda k: k - 1,
    "REDUCE_SCATTER": lambda k: (k - 1) / k,
    "ALL_TO_ALL": lambda k: (k - 1) / k,
}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
DTYPE_BYTES |= {"f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_SEND = re.compile(r"= \((\w+)\[([\d,]*)\].*?\) send\(.*_xla_megascale_transfer_type=\"(\w+)\"")
# The slices a transfer spans: ``_xla_megascale_target="{1,2}x{0:7}"`` (slices 1 and 2, chips 0 to 7 of each).
_TARGET = re.compile(r'_xla_megascale_target="\{([\d,]+)\}')
_WHILE = re.compile(r" while\(.*?condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_BOUND = re.compile(r"= s32\[\]\S* constant\((\d+)\)")
_CALLED = re.compile(r"\b(?:calls|to_apply|branch_computations)=\{?([%\w.\-, ]+)\}?")


def dcn_bytes(hlo_text: str, slices: int) -> float:
    """The bytes one chip sends over DCN in one run of the compiled program ``hlo_text`` (``compiled.as_text()``)
    whose devices span ``slices`` slices (a transfer that names the slices it spans counts those); 0 for a program
    without DCN transfers."""
    own: dict[str, float] = {}
    loops: dict[str, list[tuple[str, str]]] = {}  # computation -> its loops' (condition, body)
    calls: dict[str, list[str]] = {}
    bounds: dict[str, list[int]] = {}  # a computation's s32 constants (a condition's: its bound)
    peeled: set[str] = set()
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            entry = current if line.startswith("ENTRY") else entry
            own[current], loops[current], calls[current], bounds[current] = 0.0, [], [], []
            if "(loop_peel_cond_param:" in line:
                peeled.add(current)
            continue
        if current is None:
            continue
        bound = _BOUND.search(line)
        if bound:
            bounds[current].append(int(bound.group(1)))
        send = _SEND.search(line)
        if send and "is_host_transfer=true" in line:
            dtype, dims, kind = send.groups()
            target = _TARGET.search(line)
            spanned = len(target.group(1).split(",")) if target else slices
            size = DTYPE_BYTES.get(dtype, 4) * _product(dims)
            own[current] += size * RING_FACTORS.get(kind, lambda k: 1.0)(spanned)
        loop = _WHILE.search(line)
        if loop:
            loops[current].append((loop.group(1), loop.group(2)))
        elif " while(" not in line:
            for group in _CALLED.findall(line):
                calls[current] += [name.strip().lstrip("%") for name in group.split(",") if name.strip()]

    def trips(condition: str) -> int:
        found = bounds.get(condition, [])
        if len(found) != 1:
            return 1
        return max(found[0] - (condition in peeled), 1)

    totals: dict[str, float] = {}

    def total(name: str) -> float:
        if name not in own:
            return 0.0
        if name not in totals:
            totals[name] = 0.0  # a cycle (none in HLO) would count once
            totals[name] = (
                own[name]
                + sum(trips(condition) * total(body) for condition, body in loops[name])
                + sum(total(callee) for callee in calls[name])
            )
        return totals[name]

    return total(entry) if entry else 0.0


def _product(dims: str) -> int:
    count = 1
    for dim in filter(None, dims.split(",")):
        count *= int(dim)
    return count
