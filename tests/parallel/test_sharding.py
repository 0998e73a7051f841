"""Mesh, rules and shardings: pure checks in this process, device checks on 8 simulated CPU devices."""

import json
import re
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import run_python
from functrain.parallel import distributed, launcher, sharding
from functrain.errors import ConfigError


def mesh_config(data=-1, fsdp=1, tensor=1, rules=None, allow_replicated_fallback=False):
    return SimpleNamespace(data=data, fsdp=fsdp, tensor=tensor, rules=rules,
                           allow_replicated_fallback=allow_replicated_fallback)


# ------------------------------------------------------------------------------------------ in-process

def test_mesh_shape_fills_the_minus_one_axis():
    assert sharding.resolve_mesh_shape(mesh_config(data=-1, fsdp=2, tensor=2), 8) == \
        {"pipeline": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert sharding.resolve_mesh_shape(mesh_config(data=1, fsdp=-1), 8) == \
        {"pipeline": 1, "data": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1}


def test_mesh_product_mismatch_names_device_count_and_a_fitting_mesh():
    with pytest.raises(ConfigError) as err:
        sharding.resolve_mesh_shape(mesh_config(data=2, fsdp=2, tensor=1), 8)
    message = str(err.value)
    assert "\n" not in message
    assert "8 are available" in message and "mesh.data=2 mesh.fsdp=2 mesh.expert=1 mesh.context=1 mesh.tensor=1" in message
    assert "mesh.data=4 mesh.fsdp=2 mesh.expert=1 mesh.context=1 mesh.tensor=1" in message  # keeps fsdp, gives the rest to data
    with pytest.raises(ConfigError, match="only one mesh axis may be -1"):
        sharding.resolve_mesh_shape(mesh_config(data=-1, fsdp=-1), 8)
    with pytest.raises(ConfigError, match="not divisible by 3"):
        sharding.resolve_mesh_shape(mesh_config(data=-1, fsdp=3), 8)


def test_make_mesh_on_one_device_rejects_a_larger_mesh():
    with pytest.raises(ConfigError, match="needs 2 devices but 1 are available"):
        sharding.make_mesh(mesh_config(data=1, fsdp=2))


def test_rules_override_defaults_and_reject_unknown_mesh_axes():
    rules = dict(sharding.logical_rules(mesh_config(rules={"mlp": None, "vocab": ["fsdp", "tensor"]})))
    assert rules["embed"] == "fsdp" and rules["mlp"] is None and rules["vocab"] == ("fsdp", "tensor")
    with pytest.raises(ConfigError) as err:
        sharding.logical_rules(mesh_config(rules={"embed": "model"}))
    assert "'model'" in str(err.value) and "mesh.rules.embed" in str(err.value)


def test_launcher_flags_are_stripped():
    argv = ["train", "c.yaml", "--processes", "2", "x=1", "--port=1234", "--processes=3"]
    assert launcher.strip_processes_flag(argv) == ["train", "c.yaml", "x=1"]


def test_launch_local_rejects_a_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError) as err:
            launcher.launch_local(["train", "c.yaml"], 2, port)
    assert f"port {port}" in str(err.value) and "\n" not in str(err.value)


def test_supervise_stops_the_others_when_one_fails(tmp_path):
    log = tmp_path / "p1.log"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(log, "wb") as out:
        failing = subprocess.Popen([sys.executable, "-c", "print('boom'); raise SystemExit(1)"], stdout=out)
    start = time.monotonic()
    assert launcher.supervise([sleeper, failing], [None, log]) == 1
    assert time.monotonic() - start < 30 and sleeper.poll() is not None


def test_initialize_from_env_is_a_no_op_for_a_single_process(monkeypatch):
    for name in (launcher.ENV_COORDINATOR, "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize_from_env() is False
    assert distributed.is_primary()


@pytest.mark.parametrize("env, expected", [
    ({launcher.ENV_COORDINATOR: "10.0.0.1:1234", launcher.ENV_NUM_PROCESSES: "4",
      launcher.ENV_PROCESS_ID: "3"}, ("10.0.0.1:1234", 4, 3)),
    ({"SLURM_NTASKS": "2"}, ()),
    ({"TPU_WORKER_HOSTNAMES": "host-0,host-1"}, ()),
])
def test_initialize_from_env_joins_the_job_it_finds(monkeypatch, env, expected):
    calls = []
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda *args: calls.append(args))
    monkeypatch.setattr(distributed.jax.config, "update", lambda *args: calls.append(("config",) + args))
    monkeypatch.setattr(distributed, "_initialized", False)
    for name in (launcher.ENV_COORDINATOR, "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert distributed.initialize_from_env() is True
    assert calls[-1] == expected
    assert (("config", "jax_cpu_collectives_implementation", "gloo") in calls) == bool(expected)
    assert distributed.initialize_from_env() is True and len([c for c in calls if c[:1] != ("config",)]) == 1


# --------------------------------------------------------------------------------------- 8 CPU devices

DEVICE_CHECKS = r"""
import json, logging
import jax, numpy as np, optax
from functrain.parallel import sharding as S
from functrain.data import batch_sharding
from functrain.config.load import load_config
from functrain.errors import ConfigError
from functrain.core.state import TrainState
from functrain.models import build_model
from functrain.core.program import as_program

out = {}
def run(overrides, model="gpt"):
    cfg = load_config(None, overrides, base={"model": {"name": model}})
    batch = ({"tokens": np.zeros((8, 9), np.int32), "weight": np.ones(8, np.float32)} if model == "gpt" else
             {"x": np.zeros((8, 64), np.float32), "y": np.zeros(8, np.int32), "weight": np.ones(8, np.float32)})
    program = as_program(build_model(cfg.model), batch)
    mesh = S.make_mesh(cfg.mesh)
    tx = optax.adamw(1e-3)
    init = lambda rng: TrainState.create(program.init(rng)[0], tx, rng)
    abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
    params_sh = S.param_shardings(program.logical_specs(), abstract.params, mesh, S.logical_rules(cfg.mesh),
                                  cfg.mesh.allow_replicated_fallback)
    state_sh = S.state_shardings(abstract, params_sh, mesh)
    return mesh, abstract, state_sh, init

# ZeRO-3: params and Adam moments sharded 8 ways; bytes measured on the created arrays themselves.
mesh, abstract, state_sh, init = run(["mesh.data=1", "mesh.fsdp=8"])
state = jax.jit(init, out_shardings=state_sh)(jax.random.PRNGKey(0))
leaves = jax.tree.leaves(state)
out["fsdp8_total"] = sum(x.nbytes for x in leaves)
out["fsdp8_per_device"] = max(sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == d)
                             for d in jax.devices())
out["fsdp8_estimate"] = S.state_bytes_per_device(abstract, state_sh)[0]
out["mu_spec"] = str(state.opt_state[0].mu["block_0"]["mlp_in"]["kernel"].sharding.spec)
out["kernel_spec"] = str(state.params["block_0"]["mlp_in"]["kernel"].sharding.spec)
out["rng_spec"] = str(state.rng.sharding.spec)
out["count_spec"] = str(state.opt_state[0].count.sharding.spec)
out["describe"] = S.describe(state, state_sh, mesh, top=3)

mesh, _, state_sh, _ = run(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
out["tp_attn_out"] = str(state_sh.params["block_0"]["attn_out"]["kernel"].spec)
out["batch_spec"] = str(batch_sharding(mesh, batch_axis=1).spec)
out["batch_spec_flat"] = str(batch_sharding(mesh, batch_axis=0).spec)
out["batch_devices"] = S.batch_devices(mesh)
with jax.set_mesh(mesh):
    pinned = jax.jit(lambda x: S.constrain_batch(x) * 2)(np.ones((8, 4), np.float32))
out["constrained_spec"] = str(pinned.sharding.spec)

# An MLP hidden width of 6 cannot be split 4 ways on the tensor axis.
try:
    run(["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4", "model.hidden=[6]"], model="mlp")
except ConfigError as exc:
    out["divisible_error"] = str(exc)
warnings = []
class Catch(logging.Handler):
    def emit(self, record): warnings.append(record.getMessage())
logging.getLogger("functrain.parallel.sharding").addHandler(Catch())
_, _, state_sh, _ = run(["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4", "model.hidden=[6]",
                         "mesh.allow_replicated_fallback=true"], model="mlp")
out["fallback_spec"] = str(state_sh.params["dense_0"]["kernel"].spec)
out["fallback_warnings"] = warnings
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def device_results():
    proc = run_python(DEVICE_CHECKS, devices=8)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_fsdp8_state_per_device_is_an_eighth(device_results):
    total, per_device = device_results["fsdp8_total"], device_results["fsdp8_per_device"]
    assert per_device <= total / 8 * 1.10, (per_device, total)
    assert device_results["fsdp8_estimate"] == per_device  # describe()'s figure matches the real arrays
    assert device_results["kernel_spec"] == "P('fsdp',)"
    assert device_results["mu_spec"] == device_results["kernel_spec"]  # Adam moments follow their params
    assert device_results["rng_spec"] == device_results["count_spec"] == "P()"


def test_describe_shows_mesh_largest_params_and_bytes(device_results):
    text = device_results["describe"]
    assert "mesh: pipeline=1 data=1 fsdp=8 expert=1 context=1 tensor=1" in text
    assert "block_0/mlp_in/kernel" in text and "P('fsdp',)" in text
    share = float(re.search(r"state per device: .* total \(([\d.]+)%\)", text).group(1))
    assert 12.5 <= share <= 12.5 * 1.10  # ~1/8 of the state


def test_tensor_and_batch_shardings(device_results):
    assert device_results["tp_attn_out"] == "P('tensor', None, 'fsdp')"
    assert device_results["batch_spec"] == "P(None, ('data', 'fsdp', 'expert'))"
    assert device_results["batch_spec_flat"] == "P(('data', 'fsdp', 'expert'),)"
    assert device_results["batch_devices"] == 4
    assert device_results["constrained_spec"].startswith("P(('data', 'fsdp')")


def test_constrain_batch_is_identity_without_a_mesh():
    x = np.ones((8, 4), np.float32)
    assert sharding.constrain_batch(x) is x


def test_non_divisible_dimension_names_param_dim_and_axis(device_results):
    message = device_results["divisible_error"]
    assert "'dense_0/bias' dimension 0 (size 6" in message and "mesh axis 'tensor' (size 4)" in message
    assert "mesh.allow_replicated_fallback=true" in message


def test_fallback_replicates_only_that_dimension_with_a_warning(device_results):
    assert device_results["fallback_spec"] == "P('fsdp',)"  # embed still sharded, mlp replicated
    assert any("dense_0/kernel dimension 1 (size 6" in warning for warning in device_results["fallback_warnings"])
