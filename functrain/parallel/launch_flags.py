"""The flags a launcher acts on itself and does not pass on to the commands it starts (no JAX import here)."""

from __future__ import annotations


def without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without each of ``flags`` and its value (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in flags)):
            out.append(arg)
    return out
