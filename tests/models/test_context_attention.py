"""Attention with the sequence split over ``context`` (4 simulated devices: context 2 x tensor 2) equals one
device's, in output and gradients: splash (its mask computed from the queries' true positions, each device
reading its part), and XLA with a sliding window, soft-cap and attention sinks; packed segments in both. A device
of a context-split model computes no more than a device of a data-split one (the LM head and the chunked
cross-entropy included)."""

from tests.conftest import run_python

CHECK = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType
from functrain.models.attention import attend, pallas_interpreted
from functrain.parallel.context import from_context_order, to_context_order
from functrain.parallel.sharding import MESH_AXES

rng = np.random.default_rng(0)
query, key, value = (jnp.asarray(rng.normal(size=(2, 256, heads, 16)), jnp.float32) for heads in (4, 2, 2))
segments = jnp.asarray(np.sort(rng.integers(0, 3, (2, 256)), axis=1), jnp.int32)
sinks = jnp.asarray(rng.normal(size=4), jnp.float32)
CASES = {"splash": dict(kernel="splash"), "xla": dict(kernel="xla", window=40, softcap=3.0, sinks=sinks)}

def loss_and_grads(options, ways):
    def loss(q, k, v):
        split = lambda x: to_context_order(x, ways)
        out = attend(split(q), split(k), split(v), scale=0.25, segment_ids=split(segments), **options)
        return jnp.sum(jnp.sin(from_context_order(out, ways)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(query, key, value)

sizes = {"context": 2, "tensor": 2}
mesh = jax.make_mesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
with pallas_interpreted():
    for name, options in CASES.items():
        whole = loss_and_grads(options, 1)
        with jax.set_mesh(mesh):
            split = loss_and_grads(options, 2)
        for ours, theirs in zip(jax.tree.leaves(split), jax.tree.leaves(whole)):  # the loss sums 32k terms
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5, err_msg=name)
        print(name, "equal")

# No device computes another's share: a small Llama's loss (chunked cross-entropy: strided chunks) and gradient
# cost as many FLOPs a device split over context as over data.
import flax.linen as nn
from functrain.core.losses import causal_lm_sums
from functrain.models import build_model
from functrain.models.configs.llama import LlamaConfig
model = build_model(LlamaConfig(name="llama", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2, attention="xla"))
tokens = jax.ShapeDtypeStruct((4, 513), jnp.int32)
params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((4, 8), jnp.int32))["params"]))
def loss(p, tokens):
    batch = {"tokens": tokens, "weight": jnp.ones(4)}
    return causal_lm_sums(model.apply({"params": p}, tokens[:, :-1], logits_chunk=64), batch)[0]
flops = {}
for name, sizes in {"data": {"data": 4}, "context": {"data": 2, "context": 2}}.items():
    mesh = jax.make_mesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    with jax.set_mesh(mesh):
        flops[name] = jax.jit(jax.grad(loss)).lower(params, tokens).compile().cost_analysis()["flops"]
assert abs(flops["context"] / flops["data"] - 1) < 0.02, flops
print("flops", flops)
"""


def test_context_split_attention_equals_one_device_in_output_and_gradients():
    proc = run_python(CHECK, devices=4)
    assert "splash" in proc.stdout and "xla" in proc.stdout and "flops" in proc.stdout, proc.stdout
