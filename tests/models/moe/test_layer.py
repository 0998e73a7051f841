"""The MoE layer: the grouped dispatch equals the dense one (biases, any routing), the capacity drops the
selections past it in token order, routing matches its definition, and the statistics are masked sums."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functrain.models.moe.dispatch import ExpertWeights, capacity, dense, grouped, within_capacity
from functrain.models.moe.layer import MoeBlock
from functrain.models.moe.routing import softmax_topk

TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 10, 6, 5, 4, 2


def glu(gate, up):
    return jax.nn.silu(gate) * up


@pytest.fixture(scope="module")
def case():
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    weights = ExpertWeights(
        jax.random.normal(keys[0], (EXPERTS, HIDDEN, INTER)),
        jax.random.normal(keys[1], (EXPERTS, HIDDEN, INTER)),
        jax.random.normal(keys[2], (EXPERTS, INTER, HIDDEN)),
        jax.random.normal(keys[3], (EXPERTS, INTER)),
        jax.random.normal(keys[4], (EXPERTS, INTER)),
        jax.random.normal(keys[5], (EXPERTS, HIDDEN)),
    )
    x = jax.random.normal(keys[6], (TOKENS, HIDDEN))
    routing = softmax_topk(jax.random.normal(keys[7], (TOKENS, EXPERTS)), TOP_K, normalize=False)
    return x, routing, weights


def test_grouped_equals_dense_and_the_loop_definition(case):
    x, routing, w = case
    with jax.default_matmul_precision("highest"):
        fast = grouped(x, routing.weights, routing.experts, w, glu)
        slow = dense(x, routing.weights, routing.experts, w, glu)
        expected = np.zeros((TOKENS, HIDDEN))
        for t in range(TOKENS):
            for j in range(TOP_K):
                e = int(routing.experts[t, j])
                hidden = glu(x[t] @ w.gate[e] + w.gate_bias[e], x[t] @ w.up[e] + w.up_bias[e])
                expected[t] += float(routing.weights[t, j]) * np.asarray(hidden @ w.down[e] + w.down_bias[e])
    np.testing.assert_allclose(fast, expected, atol=1e-4)
    np.testing.assert_allclose(slow, expected, atol=1e-4)


def test_gradients_of_both_paths_agree(case):
    x, routing, w = case
    with jax.default_matmul_precision("highest"):
        grads = [
            jax.grad(lambda w: jnp.sum(path(x, routing.weights, routing.experts, w, glu) ** 2))(w)
            for path in (grouped, dense)
        ]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3), *grads)


def test_softmax_topk_weights():
    logits = jnp.array([[0.0, 1.0, 2.0, 3.0]])
    probs = jax.nn.softmax(logits)
    plain = softmax_topk(logits, 2, normalize=False)
    assert plain.experts.tolist() == [[3, 2]]
    np.testing.assert_allclose(plain.weights, probs[:, [3, 2]], rtol=1e-6)
    # Renormalised top-k probabilities are the softmax of the top-k logits (Mixtral's definition).
    np.testing.assert_allclose(softmax_topk(logits, 2, normalize=True).weights, jax.nn.softmax(logits[:, [3, 2]]))


def test_capacity_keeps_the_first_selections_in_token_order():
    experts = jnp.array([[0, 1], [0, 2], [0, 1], [3, 0]])
    assert capacity(4, 2, 4, 1.0) == 2
    kept = within_capacity(experts, 4, 2)
    assert kept.tolist() == [[True, True], [True, True], [False, True], [True, False]]


def test_block_statistics_are_masked_sums():
    block = MoeBlock(
        num_experts=EXPERTS,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        router=functools.partial(softmax_topk, top_k=TOP_K, normalize=True),
        glu=glu,
        capacity_factor=0.5,
    )
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, HIDDEN))
    mask = jnp.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], jnp.float32)
    variables = block.init(jax.random.PRNGKey(2), x)
    _, stats = block.apply(variables, x, mask)
    _, unmasked = block.apply(variables, x)
    assert float(stats.tokens) == 7 and float(unmasked.tokens) == 10
    assert float(jnp.sum(stats.counts)) == 7 * TOP_K
    np.testing.assert_allclose(jnp.sum(stats.prob_sums), 7.0, rtol=1e-5)
    limit = capacity(10, TOP_K, EXPERTS, 0.5)
    assert float(unmasked.dropped) == float(jnp.sum(jnp.maximum(unmasked.counts - limit, 0)))
    assert float(unmasked.dropped) > 0
