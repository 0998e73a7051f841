"""``model.attention=splash``: the Pallas TPU kernel, run here by the Pallas interpreter, against the XLA kernel
(outputs, gradients, the first training steps of a GPT and a Llama-family model), and ``auto``'s choice by the
platform a run is compiled for; asking for splash where it cannot run is one line."""

from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

from functrain.core.program import as_program
from functrain.core.state import TrainState
from functrain.core.step import make_train_call, make_train_step
from functrain.errors import ConfigError
from functrain.models import build_model
from functrain.models.attention import attend, attention_kernel, pallas_interpreted
from functrain.models.gpt import GPTConfig
from functrain.models.mistral import MistralConfig
from functrain.models.splash import padded_length
from functrain.parallel.sharding import MESH_AXES
from functrain.parallel.target import compiling_for

TPU = SimpleNamespace(platform="tpu", device_kind="TPU v5")


def one_device_mesh():
    """A ``(data, fsdp, tensor)`` mesh: under it splash runs inside shard_map, as in a sharded train call."""
    return jax.make_mesh((1,) * len(MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def test_splash_matches_xla_in_output_and_gradients():
    """Grouped-query heads, packed segments, a sliding window and Gemma 2's soft-cap, on a sequence of 24 that
    the kernel pads to its 128-token block."""
    rng = np.random.default_rng(0)
    query, key, value = (jnp.asarray(rng.normal(size=(2, 24, heads, 8)), jnp.float32) for heads in (4, 2, 2))
    cotangent = jnp.asarray(rng.normal(size=(2, 24, 4, 8)), jnp.float32)
    segment_ids = jnp.asarray([[0] * 10 + [1] * 14, [3] * 24], jnp.int32)

    def output_and_grads(kernel):
        def weighted(q, k, v):
            out = attend(q, k, v, scale=0.3, kernel=kernel, segment_ids=segment_ids, window=5, softcap=2.0)
            return jnp.sum(out * cotangent), out
        return jax.grad(weighted, argnums=(0, 1, 2), has_aux=True)(query, key, value)

    with pallas_interpreted():
        (splash_grads, splash_out), (xla_grads, xla_out) = jax.jit(
            lambda: (output_and_grads("splash"), output_and_grads("xla")))()
    assert splash_out.shape == (2, 24, 4, 8)
    np.testing.assert_allclose(splash_out, xla_out, atol=1e-5, rtol=1e-5)
    for name, ours, theirs in zip("qkv", splash_grads, xla_grads):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_splash_takes_attention_sinks_in_output_and_gradients():
    """GPT-OSS's per-head sinks inside the kernel, under a mesh (the sinks follow the heads into shard_map), with
    a window, packed segments and grouped-query heads: outputs and every gradient, the sinks' included."""
    rng = np.random.default_rng(1)
    query, key, value = (jnp.asarray(rng.normal(size=(2, 24, heads, 8)), jnp.float32) for heads in (4, 2, 2))
    sinks = jnp.asarray(rng.normal(size=(4,)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(2, 24, 4, 8)), jnp.float32)
    segment_ids = jnp.asarray([[0] * 10 + [1] * 14, [3] * 24], jnp.int32)

    def output_and_grads(kernel):
        def weighted(q, k, v, s):
            out = attend(q, k, v, scale=0.3, kernel=kernel, segment_ids=segment_ids, window=5, sinks=s)
            return jnp.sum(out * cotangent), out
        return jax.grad(weighted, argnums=(0, 1, 2, 3), has_aux=True)(query, key, value, sinks)

    with pallas_interpreted(), jax.set_mesh(one_device_mesh()):
        (splash_grads, splash_out), (xla_grads, xla_out) = jax.jit(
            lambda: (output_and_grads("splash"), output_and_grads("xla")))()
    np.testing.assert_allclose(splash_out, xla_out, atol=1e-5, rtol=1e-5)
    for name, ours, theirs in zip(("q", "k", "v", "sinks"), splash_grads, xla_grads):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")
    assert float(jnp.max(jnp.abs(xla_grads[3]))) > 1e-2  # the sinks do move the output


def random_params(model, tokens, seed=0):
    """Parameters drawn with numpy (compiling threefry for every initializer costs more than the test)."""
    rng = np.random.default_rng(seed)
    shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)["params"])
    return jax.tree.map(lambda leaf: jnp.asarray(rng.normal(0, 0.2, leaf.shape), leaf.dtype), shapes)


def packed_batches(steps, rng):
    """``steps`` batches of 2 rows of 24 tokens, the first row packing two documents."""
    tokens = rng.integers(0, 64, size=(steps, 2, 25)).astype(np.int32)
    segment_ids = np.broadcast_to(np.array([[1] * 11 + [2] * 14, [1] * 25], np.int32), (steps, 2, 25))
    positions = np.broadcast_to(np.array([list(range(11)) + list(range(14)), list(range(25))], np.int32),
                                (steps, 2, 25))
    return {"tokens": tokens, "weight": np.ones((steps, 2), np.float32), "segment_ids": segment_ids.copy(),
            "positions": positions.copy()}


def test_first_training_steps_match_xla_for_a_gpt_and_a_grouped_query_windowed_llama():
    """Three SGD steps of the functrain step under a mesh (splash inside shard_map): a GPT (4 heads) and a
    Mistral (Llama with a sliding window: 4 query heads over 2 key/value heads) on packed rows."""
    configs = {"gpt": GPTConfig(vocab_size=64, max_len=32, d_model=32, n_layers=1, n_heads=4, d_ff=64),
               "mistral": MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        sliding_window=5)}
    batches = packed_batches(3, np.random.default_rng(1))
    first = {name: value[0] for name, value in batches.items()}
    tx = optax.sgd(0.5)  # AdamW would only add compile time

    calls, states = {}, {}
    with pallas_interpreted():
        for kernel in ("splash", "xla"):
            for name, config in configs.items():
                model = build_model(config.model_copy(update={"attention": kernel}))
                program = as_program(model, first, kind="causal_lm")
                calls[kernel, name] = make_train_call(make_train_step(program.loss_fn, tx, stateful=True))
                params = random_params(model, first["tokens"][:, :-1])
                states[kernel, name] = TrainState.create(params, tx, jax.random.PRNGKey(0))
        with jax.set_mesh(one_device_mesh()):  # all four runs in one compile
            losses = jax.jit(lambda states: {run: call(states[run], batches)[1]["loss"]
                                             for run, call in calls.items()})(states)
    losses = {kernel: {name: np.asarray(losses[kernel, name]) for name in configs} for kernel in ("splash", "xla")}
    for name in configs:
        assert losses["splash"][name].shape == (3,) and np.all(np.isfinite(losses["splash"][name]))
        assert losses["xla"][name][0] != losses["xla"][name][2]  # the steps train
        np.testing.assert_allclose(losses["splash"][name], losses["xla"][name], atol=1e-5, rtol=0, err_msg=name)


def test_auto_picks_splash_for_a_tpu_where_it_takes_the_shape_and_xla_elsewhere():
    assert attention_kernel("auto", jnp.float32, 64) == "xla"  # this process's CPU
    with compiling_for([TPU]):
        assert attention_kernel("auto", jnp.bfloat16, 128) == "splash"
        assert attention_kernel("auto", jnp.float32, 256) == "splash"
        assert attention_kernel("auto", jnp.float16, 128) == "xla"  # Mosaic has no float16 loads
        assert attention_kernel("auto", jnp.bfloat16, 512) == "xla"  # wider heads overflow its VMEM
        assert attention_kernel("xla", jnp.bfloat16, 128) == "xla"
        with jax.set_mesh(one_device_mesh()):  # tracing under a mesh: the mesh's devices decide
            assert attention_kernel("auto", jnp.bfloat16, 128) == "xla"
    with pallas_interpreted():
        assert attention_kernel("auto", jnp.float32, 8) == "splash"
    assert [padded_length(n) for n in (16, 128, 200, 384, 1024, 1100)] == [
        (128, 128), (128, 128), (256, 256), (384, 128), (1024, 512), (1152, 128)]


@pytest.mark.parametrize("dtype, head_dim, expected", [
    (jnp.float16, 64, "model.attention=splash needs train.compute_dtype bfloat16 or float32 (got float16); "
                      "set model.attention=xla (or auto)"),
    (jnp.bfloat16, 512, "model.attention=splash needs a head width up to 256 (got 512); set model.attention=xla "
                        "(or auto)"),
])
def test_splash_refuses_in_one_line_what_the_kernel_cannot_take(dtype, head_dim, expected):
    with compiling_for([TPU]), pytest.raises(ConfigError) as raised:
        attention_kernel("splash", dtype, head_dim)
    assert str(raised.value) == expected


def test_the_torch_twin_refuses_splash():
    from torch_bridge.twins import refuse_untwinned
    with pytest.raises(ConfigError, match=r"^model.attention=splash is not implemented by the torch gpt twin "
                                          r"\(backend: torch\); remove model.attention or set backend=jax$"):
        refuse_untwinned(GPTConfig(attention="splash"))


SPLASH_RUN = {
    "model": {"name": "gpt", "vocab_size": 256, "max_len": 32, "d_model": 32, "n_layers": 1, "n_heads": 2,
              "d_ff": 64, "attention": "splash"},
    "data": {"name": "char_text", "seq_len": 16, "global_batch_size": 4, "eval_fraction": 0.0},
    "optimizer": {"name": "adamw", "learning_rate": 0.01, "warmup_steps": 0},
    "train": {"max_steps": 4, "steps_per_call": 2},
    "checkpoint": {"every_steps": 2, "async_save": False},
    "log": {"every_steps": 2, "progress": False, "tensorboard": False},
}


def test_a_splash_run_resumes_bitwise(tmp_path, compilation_cache):
    """A run with the Pallas kernel (interpreted here), stopped at its step-2 checkpoint and resumed, ends with
    the params and losses of the run that never stopped (the compilation cache compiles its call once)."""
    import json
    import shutil

    import functrain
    from functrain.checkpoint import load_params
    from functrain.checkpoint.digest import params_digest

    def losses(run_dir):
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {line["step"]: line["loss"] for line in lines if line["split"] == "train"}

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    with pallas_interpreted():
        functrain.fit(SPLASH_RUN, **{"run.dir": str(whole)})
        shutil.copytree(whole, resumed)
        shutil.rmtree(resumed / "checkpoints" / "4")
        functrain.fit(SPLASH_RUN, **{"run.dir": str(resumed)})
    assert params_digest(load_params(resumed, 4)) == params_digest(load_params(whole, 4))
    assert losses(resumed) == losses(whole) and len(losses(whole)) == 2
