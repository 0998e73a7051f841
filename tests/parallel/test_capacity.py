"""A train state larger than the free memory is refused from its shapes, before anything is allocated."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from functrain.core.state import TrainState
from functrain.errors import ConfigError
from functrain.parallel import capacity, sharding

GIB = 2**30


def _abstract_state(rows: int, cols: int):
    """A Dense-like state of ``rows x cols`` float32 params with Adam's two moments, as shapes only."""
    # Shapes, not zeros: 4 GiB of zeros took 8 s of CPU to allocate and fill.
    params = {"kernel": jax.ShapeDtypeStruct((rows, cols), jnp.float32), "bias": jax.ShapeDtypeStruct((cols,), jnp.float32)}
    abstract = jax.eval_shape(lambda p: TrainState.create(p, optax.adam(1e-3), jax.random.PRNGKey(0)), params)
    mesh = sharding.make_mesh(SimpleNamespace(data=-1, fsdp=1, tensor=1))
    return abstract, jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), abstract), mesh


def test_a_state_larger_than_the_hosts_free_ram_is_refused_naming_the_sizes_and_the_fixes(monkeypatch):
    abstract, shardings, mesh = _abstract_state(1 << 20, 1 << 10)  # 4 GiB of params, 12 GiB with Adam's moments
    monkeypatch.setattr(capacity, "host_memory", lambda: (10 * GIB, 16 * GIB))
    with pytest.raises(ConfigError) as err:
        capacity.check_state_fits(abstract, shardings, mesh)
    message = str(err.value)
    assert "\n" not in message
    assert "needs 12.00 GiB of host memory" in message and "params 4.00 GiB, optimizer state 8.00 GiB" in message
    assert "10.00 GiB available of 16.00 GiB" in message
    assert "mesh.fsdp" in message and "smaller model" in message and "functrain plan" in message


def test_an_accelerator_compares_the_state_per_device_with_its_free_memory(monkeypatch):
    abstract, shardings, mesh = _abstract_state(1 << 20, 1 << 8)  # 3 GiB of state per device
    monkeypatch.setattr(capacity, "device_memory", lambda device: (2 * GIB, 16 * GIB))
    monkeypatch.setattr(capacity, "host_memory", lambda: (1, 1))  # unused: the state lives on the device
    with pytest.raises(ConfigError, match=r"needs 3.00 GiB per device .* has 2.00 GiB free of 16.00 GiB"):
        capacity.check_state_fits(abstract, shardings, mesh)
    monkeypatch.setattr(capacity, "device_memory", lambda device: (4 * GIB, 16 * GIB))
    capacity.check_state_fits(abstract, shardings, mesh)  # fits: no error


def test_this_hosts_memory_is_read():
    available, total = capacity.host_memory()
    assert 0 < available <= total
