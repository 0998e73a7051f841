"""``model.remat``: every policy gives the gradients of no rematerialisation, under the same parameter names
(a policy that cannot run here: ``tests/parallel/test_accelerator_options.py``)."""

import jax
import jax.numpy as jnp
import numpy as np

from functrain.models import build_model
from functrain.models.gpt import GPTConfig
from tests.models.test_attention import random_params

CONFIG = GPTConfig(vocab_size=64, max_len=16, d_model=32, n_layers=1, n_heads=4, d_ff=64)
POLICIES = ("none", "full", "dots_saveable")


def test_remat_policies_give_the_gradients_of_none():
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) % 64
    segment_ids = jnp.asarray([[0] * 5 + [1] * 7, [3] * 12], jnp.int32)
    models = [build_model(CONFIG.model_copy(update={"remat": policy})) for policy in POLICIES]

    @jax.jit  # one compile for all policies: XLA's compile time dominates this test on a CPU
    def losses_and_grads(params):
        def loss(model, p):
            return jnp.mean(model.apply({"params": p}, tokens, segment_ids=segment_ids) ** 2)
        return [jax.value_and_grad(lambda p, model=model: loss(model, p))(params) for model in models]

    (loss, grads), *rematerialised = losses_and_grads(random_params(models[0], tokens))
    for remat_loss, remat_grads in rematerialised:
        np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
        for got, want in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(grads)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_remat_keeps_the_parameter_names():
    tokens = jnp.zeros((1, 4), jnp.int32)
    shapes = [jax.eval_shape(build_model(CONFIG.model_copy(update={"remat": policy})).init, jax.random.PRNGKey(0),
                             tokens) for policy in POLICIES]
    assert all(jax.tree.structure(tree) == jax.tree.structure(shapes[0]) for tree in shapes)
