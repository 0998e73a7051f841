"""The Pallas kernels of the gated delta rule (functrain.models.delta_rule_pallas and its backward,
functrain.models.delta_rule_pallas_backward), run by the Pallas interpreter on CPU: the output, final state and
gradients (by the backward kernel) equal the XLA chunked form's on packed documents with grouped heads and an
initial state; ``model.gdn_kernel=pallas`` is refused off TPU in one line, from the layer too; both kernels compile
for TPU v5p ahead of time (Mosaic, on this CPU) and a plan counts their FLOPs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functrain.errors import ConfigError
from functrain.models.delta_rule import chunked_delta_rule, document_runs
from functrain.models.delta_rule_pallas import chunk_flops, delta_rule_kernel, pallas_delta_rule
from functrain.models.delta_rule_pallas_backward import backward_chunk_flops
from functrain.models.gated_deltanet import GatedDeltaNet
from functrain.models.splash import interpreted
from functrain.plan.counting import step_cost
from functrain.plan.planner import topology_devices

ATOL = 1e-5
# 19 tokens in chunks of 4 (the last one partial); row 0 packs three documents, one starting inside a chunk and
# one at a chunk's start; row 1 is one document.
SEGMENTS = np.array([[0] * 6 + [1] * 2 + [2] * 11, [0] * 19])


def rule_inputs() -> dict:
    """Random float32 inputs of the delta rule: 2 rows of 19 tokens, 2 key heads of width 8 serving 4 value heads
    of width 6; decays and write strengths in the ranges the layer makes."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    return dict(query=normal(2, 19, 2, 8), key=normal(2, 19, 2, 8), value=normal(2, 19, 4, 6),
                decay=-np.abs(normal(2, 19, 4)) * 0.5, beta=1 / (1 + np.exp(-normal(2, 19, 4))))  # fmt: skip


def weighted_sum_and_grad(rule, inputs: dict, runs: jax.Array, state: jax.Array) -> tuple:
    """The rule's output and final state, and the gradient of a weighted sum of both with respect to every input
    (the initial state included)."""
    rng = np.random.default_rng(1)
    out_weights = rng.normal(size=(2, 19, 4, 6)).astype(np.float32)
    state_weights = rng.normal(size=state.shape).astype(np.float32)

    def weighted(arrays: dict, initial: jax.Array) -> tuple:
        out, final = rule(**arrays, chunk_size=4, runs=runs, initial_state=initial)
        return jnp.sum(out * out_weights) + jnp.sum(final * state_weights), (out, final)

    return jax.jit(jax.grad(weighted, argnums=(0, 1), has_aux=True))(inputs, state)


@pytest.fixture(scope="module")
def both_forms() -> tuple:
    inputs = rule_inputs()
    runs = document_runs(jnp.asarray(SEGMENTS), 19, 2)
    state = jnp.asarray(np.random.default_rng(2).normal(size=(2, 4, 8, 6)).astype(np.float32))
    with interpreted():
        kernel = weighted_sum_and_grad(pallas_delta_rule, inputs, runs, state)
    return kernel, weighted_sum_and_grad(chunked_delta_rule, inputs, runs, state)


def test_the_kernel_equals_the_xla_form_in_output_and_final_state(both_forms):
    (_, (out, final)), (_, (want_out, want_final)) = both_forms
    np.testing.assert_allclose(out, want_out, atol=ATOL, rtol=0)
    np.testing.assert_allclose(final, want_final, atol=ATOL, rtol=0)


def test_gradients_through_the_kernel_equal_the_xla_form_s(both_forms):
    ((grads, state_grad), _), ((want, want_state), _) = both_forms
    for name in want:
        np.testing.assert_allclose(grads[name], want[name], atol=ATOL, rtol=0, err_msg=name)
    np.testing.assert_allclose(state_grad, want_state, atol=ATOL, rtol=0)


class _PallasLayerConfig:
    hidden_size, hidden_act, rms_norm_eps, initializer_range = 16, "silu", 1e-6, 0.02
    linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim = 1, 2, 8, 8
    linear_conv_kernel_dim, linear_chunk_size, fused_linear_projections, gdn_kernel = 2, 4, False, "pallas"


def test_pallas_is_refused_off_tpu_in_one_line_naming_the_fix():
    assert delta_rule_kernel("xla") is chunked_delta_rule
    with interpreted():
        assert delta_rule_kernel("pallas") is pallas_delta_rule
    with pytest.raises(ConfigError, match=r"^model.gdn_kernel=pallas needs a TPU .*; set model.gdn_kernel=xla"):
        layer = GatedDeltaNet(_PallasLayerConfig())
        jax.eval_shape(layer.init, jax.random.PRNGKey(0), jnp.zeros((1, 4, 16)))


def test_the_kernels_compile_for_tpu_ahead_of_time_and_a_plan_counts_their_flops():
    mesh = jax.sharding.Mesh(np.array(topology_devices("v5p:2x2x1")[:1]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shapes = dict(query=(1, 128, 1, 128), key=(1, 128, 1, 128), value=(1, 128, 2, 128), decay=(1, 128, 2),
                  beta=(1, 128, 2))  # fmt: skip
    inputs = {name: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=replicated) for name, shape in shapes.items()}
    forward = lambda arrays: pallas_delta_rule(**arrays, chunk_size=64)  # noqa: E731
    trained = jax.value_and_grad(lambda arrays: jnp.sum(forward(arrays)[0]))
    with jax.set_mesh(mesh):  # Mosaic lowers for the mesh's chip
        compiled, compiled_grad = (jax.jit(f).lower(inputs).compile() for f in (forward, trained))
    assert compiled.as_text().count("tpu_custom_call") == 1
    in_kernel = 2 * chunk_flops(64, 128, 128, groups=2)  # 2 chunks of a key head serving 2 value heads
    assert in_kernel <= step_cost(compiled, steps_per_call=1)["flops"] < 1.1 * in_kernel
    assert compiled_grad.as_text().count("tpu_custom_call") == 2  # the forward kernel and the backward kernel
    in_kernels = in_kernel + 2 * backward_chunk_flops(64, 128, 128, groups=2)
    assert in_kernels <= step_cost(compiled_grad, steps_per_call=1)["flops"] < 1.1 * in_kernels
