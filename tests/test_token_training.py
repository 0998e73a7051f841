"""The token job end to end with nothing to download: Python's own standard-library sources are tokenized to
a byte store through the CLI; ``configs/gpt_tokens.yaml`` (packed documents) trains on it through the CLI
(``cli.main`` in this process); and two ``jax.distributed`` processes assemble the same packed global batches
from the store as one process."""

import json
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO_ROOT, run_jax_processes
from functrain import cli

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "model.max_len=32",
        "data.seq_len=32", "data.global_batch_size=8", "train.max_steps=4", "train.steps_per_call=2",
        "log.every_steps=2", "log.tensorboard=false", "log.progress=false", "eval.every_steps=0",
        "data.eval_fraction=0", "checkpoint.every_steps=0", "optimizer.warmup_steps=0"]

# Shared by the test and the worker processes: the packed windows of the store, their order and a digest.
COMMON = textwrap.dedent("""
    import hashlib, os
    import numpy as np
    from functrain.data import BatchLoader, IndexSampler
    from functrain.data.token_windows import token_splits

    TRAIN, _ = token_splits(os.environ["STORE"], 32, True, 0.0, 256)
    SAMPLER = IndexSampler(len(TRAIN), 8, seed=3)
    START, STEPS, STEPS_PER_CALL = 8 * 5 + 3, 4, 2  # a resume part-way into the stream

    def digest(batch):
        h = hashlib.sha256()
        for name in sorted(batch):
            value = np.asarray(batch[name])
            h.update(name.encode() + str(value.shape).encode() + str(value.dtype).encode() + value.tobytes())
        return h.hexdigest()
""")

WORKER = COMMON + textwrap.dedent("""
    import json
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{os.environ['PORT']}", num_processes=2,
                               process_id=int(os.environ['PROCESS_ID']))
    from jax.experimental import multihost_utils
    from functrain.data import to_global

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    loader = BatchLoader(TRAIN, SAMPLER, process_index=jax.process_index(), process_count=jax.process_count())
    with loader.iter_from(START, steps_per_call=STEPS_PER_CALL, num_steps=STEPS) as calls:
        digests = [digest(multihost_utils.process_allgather(to_global(host, mesh, batch_axis=1), tiled=True))
                   for host, _, _ in calls]
    print("RESULT", json.dumps(digests))
    jax.distributed.shutdown()
""")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("token_training") / "store"
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    assert cli.main(["tokenize", *map(str, sources), str(out), "--workers", "1"]) == 0
    return out


def test_the_token_job_trains_on_stdlib_sources_through_the_cli(store, tmp_path):
    assert json.loads((store / "manifest.json").read_text())["num_docs"] == 40
    assert cli.main(["train", str(REPO_ROOT / "configs/gpt_tokens.yaml"), f"run.dir={tmp_path}",
                     f"data.path={store}", *TINY]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if row["split"] == "train"]
    assert len(losses) == 2 and np.all(np.isfinite(losses)) and losses[0] < np.log(256) + 0.5


def test_two_processes_assemble_the_packed_batches_of_one(store, monkeypatch):
    monkeypatch.setenv("STORE", str(store))
    scope: dict = {}
    exec(COMMON, scope)
    loader = scope["BatchLoader"](scope["TRAIN"], scope["SAMPLER"], prefetch=0)
    with loader.iter_from(scope["START"], steps_per_call=scope["STEPS_PER_CALL"], num_steps=scope["STEPS"]) as calls:
        expected = [scope["digest"](host) for host, _, _ in calls]
    assert len(set(expected)) == 2
    for digests in run_jax_processes(WORKER, env={"STORE": str(store)}):
        assert digests == expected
