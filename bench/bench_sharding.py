"""FSDP (ZeRO-3) memory and communication of the compiled train step vs the fsdp degree.

For fsdp = 1, 2, 4, 8 (data = 8 / fsdp, so all 8 devices hold a batch shard) the GPT train step is compiled
with the shardings functrain uses (``functrain.parallel.sharding``), and two things are read off the compiled step:

- memory per device (``compiled.memory_analysis()``): the arguments (train state + batch shard) and the
  temporaries, next to the state bytes per device computed from the shardings; the baseline is fsdp=1
  in the same run, the target state(fsdp=n) ~ state(1)/n;
- collectives (parsed from ``compiled.as_text()``): count and bytes of all-gather / reduce-scatter /
  all-reduce, against what ZeRO-3 needs per step: all-gather the sharded params for the forward (and, at
  most, once more for the backward) and reduce-scatter their gradients, each ~ the sharded params' bytes.

Runs on 8 simulated CPU devices (set before jax is imported): ``python bench/bench_sharding.py``.
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from functrain.parallel import sharding  # noqa: E402
from functrain.config.load import load_config  # noqa: E402
from functrain.data import batch_sharding  # noqa: E402
from functrain.run.parts import make_optimizer  # noqa: E402
from functrain.core.state import TrainState  # noqa: E402
from functrain.core.step import make_train_step  # noqa: E402
from functrain.models import build_model  # noqa: E402
from functrain.core.program import as_program  # noqa: E402

MODEL = ["model.name=gpt", "model.vocab_size=256", "model.max_len=128", "model.d_model=256",
         "model.n_layers=4", "model.n_heads=8", "model.d_ff=1024"]
BATCH, SEQ = 16, 128
DEVICES = 8
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "u64": 8, "s32": 4, "u32": 4, "s16": 2,
               "u16": 2, "s8": 1, "u8": 1, "pred": 1}
# "%name = SHAPE op-name(" where SHAPE is one array type or a tuple of them.
OP_LINE = re.compile(r"=\s*(?P<shape>\([^()]*\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                     r"(?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\(")
ARRAY_TYPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
# Replica groups come as a mesh and the axes communicated over (Shardy), an iota [groups,size] or a list.
MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}")
IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
LIST_GROUPS = re.compile(r"replica_groups=\{\{([0-9,]*)\}")


def _type_bytes(shape_text: str) -> list[int]:
    sizes = []
    for dtype, dims in ARRAY_TYPE.findall(shape_text):
        count = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        sizes.append(count * DTYPE_BYTES.get(dtype, 4))
    return sizes


def _group_size(line: str) -> int:
    """How many devices take part in each group of a collective."""
    if match := MESH_GROUPS.search(line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", match.group(1)))
        return int(np.prod([int(sizes[axis]) for axis in re.findall(r"'(\w+)'", match.group(2))]))
    if match := IOTA_GROUPS.search(line):
        return int(match.group(2))
    if match := LIST_GROUPS.search(line):
        return len(match.group(1).split(","))
    return DEVICES


def collectives(hlo_text: str) -> dict[tuple[str, int], dict[str, int]]:
    """Per (collective kind, devices per group): op count and bytes on one device (all-gather: gathered
    output; reduce-scatter: its full-size input; all-reduce: its operand). Async ``-start`` ops count once.

    On CPU, XLA leaves a gradient reduce-scatter as an all-reduce over the fsdp group followed by a slice
    (GPU/TPU passes turn that pair into a reduce-scatter), so the group size is what tells them apart.
    """
    stats: dict[tuple[str, int], dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for line in hlo_text.splitlines():
        match = OP_LINE.search(line)
        if not match:
            continue
        op, sizes = match.group("op"), _type_bytes(match.group("shape"))
        if match.group("start") and op == "all-gather":
            sizes = sizes[len(sizes) // 2:]  # an async all-gather's type is (operands, outputs)
        elif match.group("start") and op != "all-reduce":
            sizes = sizes[:len(sizes) // 2] or sizes
        group = _group_size(line)
        size = sum(sizes) * (group if op == "reduce-scatter" else 1)
        stats[(op, group)]["count"] += 1
        stats[(op, group)]["bytes"] += size
    return dict(stats)


def compile_step(fsdp: int):
    """Compile the GPT train step on a (data=8/fsdp, fsdp) mesh; returns (compiled, state bytes/device,
    total state bytes, bytes of the fsdp-sharded params)."""
    config = load_config(None, [*MODEL, f"mesh.data={DEVICES // fsdp}", f"mesh.fsdp={fsdp}", "mesh.tensor=1",
                                f"data.global_batch_size={BATCH}", f"data.seq_len={SEQ}"],
                         base={"model": {"name": "gpt"}})
    example = {"tokens": np.zeros((BATCH, SEQ + 1), np.int32), "weight": np.ones(BATCH, np.float32)}
    program = as_program(build_model(config.model), example)
    tx, schedule = make_optimizer(config.optimizer, total_steps=1000)
    mesh = sharding.make_mesh(config.mesh)

    def create(rng):
        return TrainState.create(program.init(rng)[0], tx, rng)

    abstract = jax.eval_shape(create, jax.random.PRNGKey(0))
    params_sh = sharding.param_shardings(program.logical_specs(), abstract.params, mesh,
                                         sharding.logical_rules(config.mesh))
    state_sh = sharding.state_shardings(abstract, params_sh, mesh)
    batch_sh = batch_sharding(mesh, batch_axis=0)
    step = make_train_step(program.loss_fn, tx, learning_rate_fn=schedule, stateful=True)
    abstract_batch = {key: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=batch_sh)
                      for key, value in example.items()}
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  abstract, state_sh)
    with jax.set_mesh(mesh):  # lets activation sharding constraints see the mesh
        compiled = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                           donate_argnums=0).lower(abstract_state, abstract_batch).compile()
    per_device, total = sharding.state_bytes_per_device(abstract, state_sh)
    sharded_params = sum(leaf.size * leaf.dtype.itemsize
                         for leaf, sh in zip(jax.tree.leaves(abstract.params), jax.tree.leaves(params_sh))
                         if "fsdp" in jax.tree.leaves(tuple(sh.spec)))
    return compiled, per_device, total, sharded_params


def _collective_text(stats: dict, mib: float) -> str:
    parts = [f"{op}/{group}: {entry['count']} ops {entry['bytes'] / mib:.2f} MiB"
             for (op, group), entry in sorted(stats.items())]
    return "; ".join(parts) or "none"


def main() -> None:
    mib = 1024 ** 2
    print(f"GPT d_model=256 n_layers=4 n_heads=8 d_ff=1024, batch {BATCH}x{SEQ}, adamw, {DEVICES} CPU devices, "
          f"mesh data=8/fsdp x fsdp; collectives as kind/devices-per-group")
    print(f"{'fsdp':>4} {'state/dev MiB':>13} {'vs fsdp=1':>9} {'args/dev MiB':>12} {'temp/dev MiB':>12}  "
          f"ZeRO-3 need  collectives per step (per device)")
    baseline = None
    for fsdp in (1, 2, 4, 8):
        compiled, per_device, total, sharded_params = compile_step(fsdp)
        baseline = baseline or per_device
        memory = compiled.memory_analysis()
        args = getattr(memory, "argument_size_in_bytes", float("nan")) / mib
        temp = getattr(memory, "temp_size_in_bytes", float("nan")) / mib
        print(f"{fsdp:>4} {per_device / mib:13.2f} {per_device / baseline:9.3f} {args:12.2f} {temp:12.2f}  "
              f"{sharded_params / mib:8.2f} MiB  {_collective_text(collectives(compiled.as_text()), mib)}")
    print(f"\ntotal train state {total / mib:.2f} MiB (params + 2 Adam moments); target: state/dev ~ 1/fsdp.\n"
          f"ZeRO-3 need = bytes of the fsdp-sharded params: all-gathered once for the forward (at most once more "
          f"for the backward) and their gradients reduce-scattered over the fsdp group (on CPU: an all-reduce "
          f"over the fsdp group, then a slice), then all-reduced over the data group at 1/fsdp size.")


if __name__ == "__main__":
    main()
