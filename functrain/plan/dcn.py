"""The bytes each chip sends over the data-centre network (DCN) in one step, read from a compiled TPU program.

libtpu compiles a collective whose groups cross slices into host transfers run by its multi-slice ("Megascale")
runtime: a ``send`` per transfer, ``is_host_transfer=true``, whose frontend attributes name the collective
(``_xla_megascale_transfer_type``: ``ALL_REDUCE``, ``ALL_GATHER``, ``REDUCE_SCATTER``, ``ALL_TO_ALL``, ...). Its
operand is this chip's buffer; over ``k`` slices a ring moves (:data:`RING_FACTORS`) ``2 (k - 1) / k`` of it for an
all-reduce, ``k - 1`` times it for an all-gather (the chip's shard to every other slice), ``(k - 1) / k`` of it for
a reduce-scatter or an all-to-all, all of it for a point-to-point transfer.

A transfer inside a loop counts once per iteration (the loop's trip count: :mod:`functrain.plan.hlo_loops`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from functrain.plan.hlo_loops import DTYPE_BYTES, Computation, Instruction, Program, elements, parse_program

# Bytes a ring sends per byte of a chip's buffer, for a transfer over ``k`` slices.
RING_FACTORS: dict[str, Callable[[int], float]] = {
    "ALL_REDUCE": lambda k: 2 * (k - 1) / k,
    "ALL_GATHER": lambda k: k - 1,
    "REDUCE_SCATTER": lambda k: (k - 1) / k,
    "ALL_TO_ALL": lambda k: (k - 1) / k,
}

_SEND = re.compile(r"= \((\w+)\[([\d,]*)\].*?\) send\(.*_xla_megascale_transfer_type=\"(\w+)\"")
# The slices a transfer spans: ``_xla_megascale_target="{1,2}x{0:7}"`` (slices 1 and 2, chips 0 to 7 of each).
_TARGET = re.compile(r'_xla_megascale_target="\{([\d,]+)\}')


def dcn_bytes(program: Program | str, slices: int) -> float:
    """The bytes one chip sends over DCN in one run of a compiled program (``compiled.as_text()``, or parsed:
    :func:`functrain.plan.hlo_loops.parse_program`) whose devices span ``slices`` slices (a transfer that names the
    slices it spans counts those); 0 for a program without DCN transfers."""
    program = parse_program(program) if isinstance(program, str) else program

    def sent(computation: Computation, instruction: Instruction) -> float:
        line = instruction.line
        send = _SEND.search(line) if " send(" in line else None
        if send is None or "is_host_transfer=true" not in line:
            return 0.0
        dtype, dims, kind = send.groups()
        target = _TARGET.search(line)
        spanned = len(target.group(1).split(",")) if target else slices
        return DTYPE_BYTES.get(dtype, 4) * elements(dims) * RING_FACTORS.get(kind, lambda k: 1.0)(spanned)

    return program.total(sent)
