"""DeepSeek-V3's routing picks transformers' experts with transformers' weights (group-limited, the correction bias
steering the choice but not the weights), and the bias update moves each expert towards its layer's mean load."""

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from functrain.models.deepseek_routing import sigmoid_group_limited, updated_bias

SETTINGS = dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5)


def _route(logits, bias):
    return sigmoid_group_limited(jnp.asarray(logits), jnp.asarray(bias), top_k=3, n_group=4, topk_group=2,
                                 normalize=True, scaling=2.5)  # fmt: skip


def test_routing_matches_transformers_router():
    router = DeepseekV3TopkRouter(transformers.DeepseekV3Config(hidden_size=16, **SETTINGS))
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.5)
    logits, weights, experts = router(torch.randn(64, 16))
    bias = router.e_score_correction_bias.numpy()
    routing = _route(logits.detach().numpy(), bias)
    order, hf_order = np.argsort(routing.experts, axis=1), np.argsort(experts.numpy(), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(routing.experts), order, 1),
                                  np.take_along_axis(experts.numpy(), hf_order, 1))  # fmt: skip
    np.testing.assert_allclose(np.take_along_axis(np.asarray(routing.weights), order, 1),
                               np.take_along_axis(weights.detach().numpy(), hf_order, 1), atol=1e-6)  # fmt: skip
    # The choice depends on the bias, the chosen experts' weights do not: they are the unbiased scores.
    unbiased = _route(logits.detach().numpy(), np.zeros_like(bias))
    assert (np.sort(unbiased.experts, 1) != np.sort(routing.experts, 1)).any()
    scores = 1 / (1 + np.exp(-logits.detach().numpy()))
    chosen = np.take_along_axis(scores, np.asarray(routing.experts), 1)
    np.testing.assert_allclose(routing.weights, 2.5 * chosen / chosen.sum(1, keepdims=True), rtol=1e-6)
    # Every token's experts lie within topk_group (2) of the n_group (4) groups of 4 experts.
    assert max(len(set(row)) for row in (np.asarray(routing.experts) // 4).tolist()) == 2


def test_bias_moves_each_expert_towards_the_mean_load():
    bias = jnp.array([[0.0, 0.1, -0.1, 0.0], [0.5, 0.5, 0.5, 0.5]])
    counts = jnp.array([[10.0, 2.0, 4.0, 4.0], [5.0, 5.0, 5.0, 5.0]])  # means 5 and 5
    np.testing.assert_allclose(updated_bias(bias, counts, 0.01), [[-0.01, 0.11, -0.09, 0.01], [0.5] * 4])
