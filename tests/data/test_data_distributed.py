"""A real two-process jax.distributed run (gloo on CPU): each process builds only its slice, ``to_global``
assembles the global batch, and the gathered global batches equal the single-process sequence."""

import textwrap

import numpy as np

from tests.conftest import run_jax_processes

# Shared by the test and the worker processes: the data, the augmentation and the batch digest.
COMMON = textwrap.dedent("""
    import hashlib
    import numpy as np
    from functrain.data import BatchLoader, IndexSampler

    ARRAYS = {"x": np.arange(30 * 3, dtype=np.float32).reshape(30, 3), "y": np.arange(30, dtype=np.int32)}
    SAMPLER = IndexSampler(30, 8, seed=7, last_batch="pad")
    START, STEPS, STEPS_PER_CALL = 19, 5, 2

    def noise(record, rng):
        return {"x": record["x"] + rng.normal(size=3).astype(np.float32), "y": record["y"]}

    def digest(batch):
        h = hashlib.sha256()
        for name in sorted(batch):
            value = np.asarray(batch[name])
            h.update(name.encode() + str(value.shape).encode() + str(value.dtype).encode() + value.tobytes())
        return h.hexdigest()
""")

WORKER = COMMON + textwrap.dedent("""
    import json, os
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{os.environ['PORT']}", num_processes=2,
                               process_id=int(os.environ['PROCESS_ID']))
    from jax.experimental import multihost_utils
    from functrain.data import to_global

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    loader = BatchLoader(ARRAYS, SAMPLER, process_index=jax.process_index(), process_count=jax.process_count(),
                         transform=noise, prefetch=2)
    digests, positions = [], []
    with loader.iter_from(START, steps_per_call=STEPS_PER_CALL, num_steps=STEPS) as calls:
        for host, start, end in calls:
            placed = to_global(host, mesh, batch_axis=1)
            assert placed["x"].shape[1] == SAMPLER.global_batch_size
            assert len(placed["x"].addressable_shards) == jax.local_device_count()
            digests.append(digest(multihost_utils.process_allgather(placed, tiled=True)))
            positions.append((start, end))
    # A mesh whose device order is not process-major would mix up samples: it is refused.
    from functrain.errors import DataError
    reversed_mesh = jax.sharding.Mesh(np.array(jax.devices()[::-1]), ("data",))
    try:
        to_global(host, reversed_mesh)
        refused = ""
    except DataError as error:
        refused = str(error)
    print("RESULT", json.dumps({"devices": jax.device_count(), "digests": digests, "positions": positions,
                                "refused": refused}))
    jax.distributed.shutdown()
""")


def test_two_process_global_batches_equal_single_process_sequence():
    scope: dict = {}
    exec(COMMON, scope)
    expected_digests, expected_positions = [], []
    loader = scope["BatchLoader"](scope["ARRAYS"], scope["SAMPLER"], transform=scope["noise"], prefetch=0)
    with loader.iter_from(scope["START"], steps_per_call=scope["STEPS_PER_CALL"], num_steps=scope["STEPS"]) as calls:
        for host, start, end in calls:
            expected_digests.append(scope["digest"](host))
            expected_positions.append([start, end])

    outputs = run_jax_processes(WORKER)

    assert len(expected_digests) == 3  # calls of 2, 2 and 1 steps
    for output in outputs:
        assert output["devices"] == 4
        assert output["digests"] == expected_digests
        assert output["positions"] == expected_positions
        assert "process-major" in output["refused"]
    assert len(set(np.ravel(expected_digests))) == 3
