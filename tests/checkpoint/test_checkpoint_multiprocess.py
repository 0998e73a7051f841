"""Two processes (2 CPU devices each) save one sharded state; it reads back in 2 processes and in 1."""

import json
import os
import subprocess
import sys
import textwrap

from tests.conftest import REPO_ROOT, free_port, run_python, xla_flags
from functrain.checkpoint import list_checkpoints

# Each process holds only its own shards; the checkpoint must still hold the whole arrays.
SAVE_AND_RESTORE = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from functrain.parallel import distributed
from functrain.checkpoint import Checkpointer, params_digest
assert distributed.initialize_from_env() and jax.process_count() == 2 and jax.device_count() == 4
run = sys.argv[1]
mesh = Mesh(np.array(jax.devices()).reshape(4), ("data",))
full = {"w": np.arange(32 * 6, dtype=np.float32).reshape(32, 6), "b": np.arange(6, dtype=np.float32)}
def place(x, spec):
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda index: x[index])
params = {"w": place(full["w"], P("data")), "b": place(full["b"], P())}
assert not params["w"].is_fully_addressable
with Checkpointer(run, keep=1) as ckpt:
    ckpt.save(1, {"params": params}, {"processes": 2})
    ckpt.save(2, {"params": params}, {"processes": 2})
# restore in the same job onto another sharding: columns over 2 devices, replicated over rows
mesh2 = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
targets = {"params": {"w": jax.ShapeDtypeStruct((32, 6), jnp.float32, sharding=NamedSharding(mesh2, P(None, "y"))),
                      "b": jax.ShapeDtypeStruct((6,), jnp.float32, sharding=NamedSharding(mesh2, P()))}}
with Checkpointer(run) as ckpt:
    items, meta, step = ckpt.restore(targets)
assert step == 2 and meta["processes"] == 2
for shard in items["params"]["w"].addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), full["w"][shard.index])
print("DIGEST", params_digest(full))
"""


def _two_processes(script: str, run_dir, devices_each: int) -> list[str]:
    """Run ``script RUN_DIR`` as a 2-process jax.distributed job (gloo); return each process's stdout."""
    port = free_port()
    procs = []
    for process_id in range(2):
        env = dict(os.environ, XLA_FLAGS=xla_flags(devices_each),
                   JAX_PLATFORMS="cpu", FUNCTRAIN_COORDINATOR=f"127.0.0.1:{port}", FUNCTRAIN_NUM_PROCESSES="2",
                   FUNCTRAIN_PROCESS_ID=str(process_id))
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), str(run_dir)],
                                      env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=240)
        finally:
            proc.kill()
        assert proc.returncode == 0, err[-3000:]
        outputs.append(out)
    return outputs


def test_two_process_save_restores_in_two_and_in_one_process(tmp_path):
    outputs = _two_processes(SAVE_AND_RESTORE, tmp_path, devices_each=2)
    digests = {line for out in outputs for line in out.splitlines() if line.startswith("DIGEST")}
    assert len(digests) == 1
    ckpt_dir = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["2"]  # step 1 rotated out once 2 committed
    single = run_python(f"""
        from functrain.checkpoint import load_params, params_digest
        print("DIGEST", params_digest(load_params({str(tmp_path)!r})))
    """, devices=1)
    assert {line for line in single.stdout.splitlines() if line.startswith("DIGEST")} == digests
    # Each process recorded checksums of the files it wrote itself; damage to either one's files is found.
    params_dir = ckpt_dir / "2" / "params"
    for process in (0, 1):
        files = json.loads((params_dir / f"checksums.process_{process}.json").read_text())["files"]
        assert files and all(name.startswith(f"ocdbt.process_{process}/") for name in files)
    data = max(params_dir.glob("ocdbt.process_1/d/*"), key=lambda p: p.stat().st_size)
    data.write_bytes(bytes(data.stat().st_size))
    [info] = list_checkpoints(tmp_path, verify=True)
    assert not info.whole and info.problem.endswith("(written by process 1)")


# Process 1 alone cannot read step 2 (as if a shard only it reads were damaged): both must resume from 1.
DAMAGE_SEEN_BY_ONE = """
import sys
import jax, numpy as np
from functrain.parallel import distributed
from functrain.checkpoint import Checkpointer, reader
assert distributed.initialize_from_env() and jax.process_count() == 2
run = sys.argv[1]
params = {"w": np.arange(12, dtype=np.float32)}
with Checkpointer(run, keep=2) as ckpt:
    ckpt.save(1, {"params": params}, {})
    ckpt.save(2, {"params": {"w": params["w"] + 1}}, {})
if jax.process_index() == 1:
    real = reader.restore_step
    def flaky(step_path, targets):
        if step_path.name == "2":
            raise reader.DamagedCheckpoint(step_path, "a shard only this process reads is truncated")
        return real(step_path, targets)
    reader.restore_step = flaky
with Checkpointer(run, keep=2) as ckpt:
    items, meta, step = ckpt.restore({"params": None})
print("RESTORED", step, float(items["params"]["w"][0]))
"""


def test_processes_agree_on_the_step_to_resume_from(tmp_path):
    outputs = _two_processes(DAMAGE_SEEN_BY_ONE, tmp_path, devices_each=1)
    restored = [line for out in outputs for line in out.splitlines() if line.startswith("RESTORED")]
    assert restored == ["RESTORED 1 0.0", "RESTORED 1 0.0"]
