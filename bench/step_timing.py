"""What the step benchmarks share: XLA's FLOP count of a compiled step and its time per step (wall and CPU)."""

import time

import jax


def compiled_flops_of(compiled) -> float:
    """XLA's FLOP count of a compiled program (a machine-independent view of its work)."""
    analysis = compiled.cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis).get("flops", 0.0)


def compiled_flops(step, state, batch) -> float:
    """XLA's FLOP count of one compiled ``step(state, batch)``."""
    return compiled_flops_of(step.lower(state, batch).compile())


def timed(step, state, batch, steps):
    """``(wall, cpu)`` seconds per step over ``steps`` steps after one compiling call, and the final state."""
    state, metrics = step(state, batch)  # compiled on the first call
    jax.block_until_ready(metrics)
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu_start) / steps, state
