"""The MoE families as functrain models: scanned layers (sparse and dense kinds grouped) and remat compute the
unrolled model's logits, router statistics and gradients; sampling with the KV cache equals sampling without;
LoRA adapts the attention and refuses the stacked experts in one line."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functrain.core.program import as_program
from functrain.errors import ConfigError
from functrain.models import build_model
from functrain.models.configs.lora import LoraConfig
from functrain.models.configs.mixtral import MixtralConfig
from functrain.models.configs.qwen_moe import Qwen2MoeConfig
from functrain.models.lora import lora_program
from functrain.models.stacking import relayout_like
from functrain.report.mfu import train_flops_per_token
from functrain.text.decode import Generator, Sampling
from tests.conftest import run_python

TOKENS = np.random.default_rng(0).integers(0, 64, (2, 12))
BATCH = {"tokens": TOKENS, "weight": np.ones(2, np.float32)}
SMALL = dict(vocab_size=64, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
             output_router_logits=True, router_aux_loss_coef=0.5, router_z_loss_coef=0.1, initializer_range=0.3)
# Layers: dense, sparse, and a third (dense) past the last whole group: scanned by period 2.
QWEN2 = Qwen2MoeConfig(**SMALL, intermediate_size=20, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=8, shared_expert_intermediate_size=12, decoder_sparse_step=2)
MIXTRAL = MixtralConfig(**SMALL, intermediate_size=8, num_hidden_layers=2, num_local_experts=4, sliding_window=6)


def host(tree):
    """``tree``'s leaves as numpy arrays: relaid out (stacked, sliced) by numpy, not op by op by JAX."""
    return jax.tree.map(np.asarray, tree)


def test_scanned_and_rematerialised_layers_compute_the_unrolled_model():
    unrolled = as_program(build_model(QWEN2), BATCH)
    scanned = as_program(build_model(QWEN2.model_copy(update={"scan_layers": True, "remat": "full"})), BATCH)
    # Compiled whole: init and the relayouts applied op by op compiled some 200 small programs.
    params, _ = jax.jit(unrolled.init)(jax.random.PRNGKey(0))
    stacked = relayout_like(host(params), jax.eval_shape(scanned.init, jax.random.PRNGKey(0))[0])

    @jax.jit
    def both(params, stacked):
        def value_and_grad(program, p):
            def loss(p):
                loss_sum, weight, aux, _ = program.loss_fn(p, {}, BATCH, jax.random.PRNGKey(0))
                return loss_sum / weight, aux
            return jax.value_and_grad(loss, has_aux=True)(p)
        return value_and_grad(unrolled, params), value_and_grad(scanned, stacked)

    with jax.default_matmul_precision("highest"):
        ((loss, aux), grads), ((scanned_loss, scanned_aux), scanned_grads) = both(params, stacked)
    np.testing.assert_allclose(scanned_loss, loss, rtol=1e-6)
    assert set(aux) == set(scanned_aux) and "moe/load_entropy/layer_1" in aux
    assert "moe/load_entropy/layer_0" not in aux and "moe/load_entropy/layer_2" not in aux  # dense: no router
    for name in aux:
        np.testing.assert_allclose(scanned_aux[name], aux[name], rtol=1e-5, err_msg=name)
    scanned_grads = relayout_like(host(scanned_grads), grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), scanned_grads, grads)


def test_sampling_with_the_cache_equals_sampling_without():
    model = build_model(MIXTRAL)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), TOKENS)["params"])
    sampling = Sampling(max_new_tokens=6)
    cached = Generator(model)(params, TOKENS[:, :5], sampling)
    uncached = Generator(model)(params, TOKENS[:, :5], sampling, use_cache=False)
    assert cached.shape == (2, 6)
    np.testing.assert_array_equal(cached, uncached)


def test_lora_adapts_attention_and_refuses_the_experts():
    program = lora_program(build_model(MIXTRAL), BATCH, "causal_lm", LoraConfig(rank=2, targets=("q_proj", "v_proj")))
    params, _ = jax.jit(program.init)(jax.random.PRNGKey(0))
    mask = program.trainable(params)
    trained = {jax.tree_util.keystr(path) for path, m in jax.tree_util.tree_flatten_with_path(mask)[0] if m}
    assert len(trained) == 2 * 2 * 2 and all("self_attn" in path for path in trained)
    grads = jax.jit(jax.grad(lambda p: program.loss_fn(p, {}, BATCH, jax.random.PRNGKey(0))[0]))(params)
    assert float(jnp.abs(grads["layers_0"]["self_attn"]["q_proj"]["lora_b"]).sum()) > 0
    for targets in (("gate_proj",), ("layers_0/mlp/experts/*",)):
        with pytest.raises(ConfigError, match="names the stacked experts layers_0/mlp/experts/") as caught:
            lora_program(build_model(MIXTRAL), BATCH, "causal_lm", LoraConfig(rank=2, targets=targets))
        assert "\n" not in str(caught.value)


# train.fp8 over two FSDP devices against one: the loss within LOSS_TOLERANCE relative (measured: equal), each
# gradient within GRADIENT_TOLERANCE of its largest value (measured: 1.9e-5; the float32 comparison above allows
# 1e-3 of each value). The sharded run's FP8 scales are the global maxima, as one device's; what differs is the
# order of the sums over the shards, whose last bits may move a gradient across an E5M2 rounding.
LOSS_TOLERANCE, GRADIENT_TOLERANCE = 1e-6, 1e-4


@pytest.fixture(scope="module")
def two_devices():
    """One process of two CPU devices (its own assertions run there): the expert dispatch on each batch shard
    against one device; then under train.fp8 the same step on one device and with its params sharded over FSDP,
    whose losses and largest gradient gaps it reports."""
    proc = run_python("""
        import json
        import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
        from jax.sharding import AxisType, NamedSharding, PartitionSpec
        from functrain.core.fp8 import with_fp8
        from functrain.models import build_model
        from tests.models.moe.test_moe_models import QWEN2, TOKENS, host

        model = build_model(QWEN2.model_copy(update={"num_hidden_layers": 2}))
        tokens = np.concatenate([TOKENS] * 4)
        params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), tokens)["params"])
        def loss(p, ids):
            output = model.apply({"params": p}, ids)
            return jnp.mean(output.logits ** 2) + jnp.mean(output.terms.router.prob_sums), output.logits
        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        with jax.default_matmul_precision("highest"):
            (plain_loss, logits), grads = step(params, tokens)
            mesh = jax.make_mesh((1, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
            with jax.set_mesh(mesh):
                sharded = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
                (_, mesh_logits), mesh_grads = step(params, sharded)
        np.testing.assert_allclose(mesh_logits, logits, rtol=1e-5, atol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6), mesh_grads, grads)

        # train.fp8: the projections in FP8, the router and the experts' grouped products in float32.
        fp8_step = jax.jit(with_fp8(jax.value_and_grad(loss, has_aux=True), True))
        (fp8_loss, _), fp8_grads = fp8_step(params, tokens)
        with jax.set_mesh(mesh):
            def fsdp(leaf):  # FSDP: each weight split over its first axis
                spec = PartitionSpec("fsdp") if leaf.ndim and leaf.shape[0] % 2 == 0 else PartitionSpec()
                return jax.device_put(leaf, NamedSharding(mesh, spec))
            fsdp_params = jax.tree.map(fsdp, params)
            (fsdp_loss, _), fsdp_grads = fp8_step(fsdp_params, sharded)
        gaps = jax.tree.leaves(jax.tree.map(  # in numpy: op by op, JAX would compile each op for each shape
            lambda a, b: float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b))), fsdp_grads, host(fp8_grads)))
        print("RESULT", json.dumps({
            "loss": float(plain_loss), "fp8_loss": float(fp8_loss), "fsdp_loss": float(fsdp_loss),
            "gradient_gap": max(gaps), "finite": bool(all(np.isfinite(g).all() for g in jax.tree.leaves(fp8_grads))),
            "sharded": sum("fsdp" in str(leaf.sharding.spec) for leaf in jax.tree.leaves(fsdp_params)),
            "experts_learn": float(np.abs(host(fp8_grads)["layers_1"]["mlp"]["experts"]["down_proj"]).max()),
        }))
    """, devices=2)
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT"):])


def test_experts_run_on_each_batch_shard_with_the_one_device_result(two_devices):
    """Under a data x fsdp mesh the dispatch sorts each shard's tokens alone (no global gather): the same logits
    and gradients as one device (asserted in the two-device process)."""
    assert two_devices["sharded"] > 0  # the process ran through its checks to the FP8 ones


def test_fp8_moe_steps_with_params_sharded_over_fsdp_give_the_one_device_result(two_devices):
    """train.fp8 on a mixture of experts (the experts' grouped products stay in float, the attention's projections
    are FP8) trains; with its params sharded over two FSDP devices, the loss and gradients of one device."""
    result = two_devices
    assert result["finite"] and result["experts_learn"] > 0
    assert result["fp8_loss"] != result["loss"]  # FP8 is on
    assert abs(result["fsdp_loss"] / result["fp8_loss"] - 1) <= LOSS_TOLERANCE, result
    assert result["gradient_gap"] <= GRADIENT_TOLERANCE, result


def test_flops_count_the_active_parameters():
    """Mixtral 8x7B's FLOPs per token are those of its active matmul parameters (2 of 8 experts, the router and
    the head: with the embedding, the published 12.9B active)."""
    mixtral = MixtralConfig(num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768)
    active = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 2 * 14336 + 4096 * 8) + 4096 * 32000
    assert round((active + 4096 * 32000) / 1e9, 1) == 12.9
    assert train_flops_per_token(mixtral.decoder_shape(), 4096) == 6 * active + 6 * 32 * 4096 * 4096
    # Qwen2-MoE's dense layer counts its own MLP, a sparse one k experts, the shared expert and its gate.
    shape = QWEN2.decoder_shape()
    sparse, dense = 2 * 8 + 12, 20
    assert shape.mlp_width == round((sparse + 2 * dense) / 3) and shape.router_width == round(5 / 3)
