"""A state saved sharded over 8 devices restores onto 4, 2 and 1 devices (separate processes)."""

import pytest

BUILD = """
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from functrain.checkpoint import Checkpointer, load_params, params_digest

def build():
    params = {"w": jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) / 7,
              "b": jnp.arange(16, dtype=jnp.float32), "emb": {"table": jnp.ones((8, 32), jnp.bfloat16)}}
    return params, optax.adamw(1e-3).init(params)

mesh = Mesh(np.array(jax.devices()), ("data",))
def sharding(x):
    spec = P("data") if x.ndim and x.shape[0] % len(jax.devices()) == 0 else P()
    return NamedSharding(mesh, spec)
"""

SAVE = BUILD + """
params, opt = build()
params = jax.tree.map(lambda x: jax.device_put(x, sharding(x)), params)
opt = jax.tree.map(lambda x: jax.device_put(x, sharding(x)), opt)
grads = jax.tree.map(jnp.sin, params)
updates, opt = jax.jit(optax.adamw(1e-3).update)(grads, opt, params)  # non-trivial moments
params = optax.apply_updates(params, updates)
assert len(params["w"].sharding.device_set) == 8
state = {"step": jnp.int32(3), "opt_state": opt, "rng": jax.random.PRNGKey(1)}
with Checkpointer(RUN) as ckpt:
    ckpt.save(3, {"params": params, "state": state}, {"devices": 8})
print("DIGEST", params_digest(jax.tree.map(np.asarray, {"params": params, "state": state})))
print("PARAMS", params_digest(jax.tree.map(np.asarray, params)))
"""

RESTORE = BUILD + """
params, opt = build()
abstract = jax.eval_shape(lambda: {"params": params, "state": {"step": jnp.int32(0), "opt_state": opt,
                                                              "rng": jax.random.PRNGKey(0)}})
targets = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x)), abstract)
with Checkpointer(RUN) as ckpt:
    items, meta, step = ckpt.restore(targets)
assert step == 3 and meta["devices"] == 8
assert items["params"]["w"].sharding.mesh.devices.size == len(jax.devices())
assert type(items["state"]["opt_state"][0]).__name__ == "ScaleByAdamState"
print("DIGEST", params_digest(jax.tree.map(np.asarray, items)))
print("PARAMS", params_digest(load_params(RUN)))
"""


def _digests(stdout: str) -> dict:
    return dict(line.split() for line in stdout.splitlines() if line.startswith(("DIGEST", "PARAMS")))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    from conftest import run_python
    run = tmp_path_factory.mktemp("mesh_run")
    proc = run_python(f"RUN = {str(run)!r}\n" + SAVE, devices=8)
    return run, _digests(proc.stdout)


@pytest.mark.parametrize("devices", [4, 2, 1])
def test_restore_onto_fewer_devices_gives_identical_values(saved_run, python_runner, devices):
    run, saved = saved_run
    proc = python_runner(f"RUN = {str(run)!r}\n" + RESTORE, devices=devices)
    assert _digests(proc.stdout) == saved
