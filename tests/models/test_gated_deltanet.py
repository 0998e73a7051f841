"""Gated DeltaNet (functrain.models.delta_rule and the layer functrain.models.gated_deltanet): the chunked and the
recurrent forms of the gated delta rule equal transformers' torch forms in the output, the final state and every
input's gradient (float32); the chunked form equals the recurrent one and restarts at each packed document; the
short convolution equals transformers'; the layer equals transformers' Qwen3-Next and Qwen3.5 layers; decoding with
its cache continues the full forward; and the FLOPs a plan counts hold the chunked form's matmuls."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as reference

from functrain.models.configs.qwen3_next import delta_rule_flops
from functrain.models.delta_rule import (
    causal_conv,
    chunked_delta_rule,
    document_runs,
    recurrent_delta_rule,
    unit_lower_inverse,
)
from functrain.models.gated_deltanet import GatedDeltaNet
from functrain.models.kv_cache import zeros_like_shapes
from functrain.plan.counting import step_cost
from tests.torch_bridge.hf.test_hf_convert import highest_precision  # noqa: F401 (a fixture)

ATOL = 1e-5


def rule_inputs(length: int, key_heads: int = 2, value_heads: int = 4, widths: tuple = (8, 6), batch: int = 2) -> dict:
    """Random float32 inputs of the delta rule (key and value ``widths``): decays and write strengths in the ranges
    the layer makes."""
    rng = np.random.default_rng(length)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    return dict(query=normal(batch, length, key_heads, widths[0]), key=normal(batch, length, key_heads, widths[0]),
                value=normal(batch, length, value_heads, widths[1]),
                decay=-np.abs(normal(batch, length, value_heads)) * 0.5,
                beta=1 / (1 + np.exp(-normal(batch, length, value_heads))))  # fmt: skip


def torch_rule(form, inputs: dict, initial: np.ndarray, weights: tuple, **options) -> tuple:
    """transformers' form on ``inputs``: output, final state and the gradients of a weighted sum of both."""
    tensors = {name: torch.tensor(array, requires_grad=True) for name, array in {**inputs, "initial": initial}.items()}
    out, state = form(tensors["query"], tensors["key"], tensors["value"], g=tensors["decay"], beta=tensors["beta"],
                      initial_state=tensors["initial"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                      **options)  # fmt: skip
    ((out * torch.tensor(weights[0])).sum() + (state * torch.tensor(weights[1])).sum()).backward()
    return out.detach().numpy(), state.detach().numpy(), {name: t.grad.numpy() for name, t in tensors.items()}


def jax_rule(form, inputs: dict, initial: np.ndarray, weights: tuple, **options) -> tuple:
    def weighted(arrays):
        out, state = form(**{k: v for k, v in arrays.items() if k != "initial"}, initial_state=arrays["initial"],
                          **options)  # fmt: skip
        return jnp.sum(out * weights[0]) + jnp.sum(state * weights[1]), (out, state)

    grads, (out, state) = jax.jit(jax.grad(weighted, has_aux=True))({**inputs, "initial": initial})
    return np.asarray(out), np.asarray(state), jax.tree.map(np.asarray, grads)


def assert_close(got: tuple, want: tuple) -> None:
    for got_part, want_part in zip(got[:2], want[:2]):
        np.testing.assert_allclose(got_part, want_part, atol=ATOL, rtol=0)
    for name, gradient in want[2].items():
        np.testing.assert_allclose(got[2][name], gradient, atol=ATOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("length, chunk, key_heads", [(37, 16, 2), (9, 4, 4)])
def test_both_forms_match_transformers_in_output_state_and_gradient(highest_precision, length, chunk, key_heads):
    inputs = rule_inputs(length, key_heads=key_heads)
    rng = np.random.default_rng(1)
    initial = rng.normal(size=(2, 4, 8, 6)).astype(np.float32)
    weights = (rng.normal(size=(2, length, 4, 6)).astype(np.float32), rng.normal(size=initial.shape).astype(np.float32))
    want_chunked = torch_rule(reference.torch_chunk_gated_delta_rule, inputs, initial, weights, chunk_size=chunk)
    want_recurrent = torch_rule(reference.torch_recurrent_gated_delta_rule, inputs, initial, weights)
    assert_close(jax_rule(chunked_delta_rule, inputs, initial, weights, chunk_size=chunk), want_chunked)
    assert_close(jax_rule(recurrent_delta_rule, inputs, initial, weights), want_recurrent)


def test_the_block_inverse_is_the_triangular_solve():
    rng = np.random.default_rng(2)
    for size in (1, 5, 8):
        lower = np.tril(rng.normal(size=(3, size, size)), -1).astype(np.float32) * 0.3
        want = np.linalg.inv(np.eye(size, dtype=np.float64) + lower)
        np.testing.assert_allclose(jax.jit(unit_lower_inverse)(lower), want, atol=1e-5, rtol=0)


# Row 0: documents starting mid-chunk, at a chunk's start (token 8) and two in one chunk; row 1: one document.
SEGMENTS = np.array([[1] * 3 + [2] * 5 + [3] * 2 + [4] * 3 + [5] * 4, [7] * 17])


DOCUMENTS = ((0, 3), (3, 8), (8, 10), (10, 13), (13, 17))


def one_document_a_row(arrays: dict, row: int = 0) -> dict:
    """Each document of ``SEGMENTS``' row alone in a row of its own, right-padded with zeros to the longest (causal:
    the padding changes nothing before it, and writes nothing)."""
    width = max(stop - start for start, stop in DOCUMENTS)
    pad = lambda x: np.pad(x, [(0, width - len(x))] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    return {name: np.stack([pad(x[row, start:stop]) for start, stop in DOCUMENTS]) for name, x in arrays.items()}


def test_the_chunked_form_is_the_recurrent_one_and_restarts_at_each_packed_document(highest_precision):
    inputs = rule_inputs(17)
    runs = document_runs(jnp.asarray(SEGMENTS), 17, 2)
    chunked, chunked_state = jax.jit(lambda a: chunked_delta_rule(**a, chunk_size=4, runs=runs))(inputs)
    recurrent, recurrent_state = jax.jit(lambda a: recurrent_delta_rule(**a, runs=runs))(inputs)
    np.testing.assert_allclose(chunked, recurrent, atol=ATOL, rtol=0)
    np.testing.assert_allclose(chunked_state, recurrent_state, atol=ATOL, rtol=0)
    alone, alone_states = jax.jit(lambda a: chunked_delta_rule(**a, chunk_size=4))(one_document_a_row(inputs))
    for row, (start, stop) in enumerate(DOCUMENTS):
        np.testing.assert_allclose(chunked[0, start:stop], alone[row, : stop - start], atol=ATOL, rtol=0)
    np.testing.assert_allclose(chunked_state[0], alone_states[-1], atol=ATOL, rtol=0)  # the last document's
    whole, _ = jax.jit(lambda a: chunked_delta_rule(**a, chunk_size=4))({k: v[1:] for k, v in inputs.items()})
    np.testing.assert_allclose(chunked[1:], whole, atol=ATOL, rtol=0)


def test_the_convolution_matches_transformers_and_restarts_at_each_packed_document():
    rng = np.random.default_rng(3)
    x, weight = rng.normal(size=(2, 17, 5)).astype(np.float32), rng.normal(size=(5, 1, 4)).astype(np.float32)
    kernel = weight[:, 0, :].T
    out, tail = causal_conv(jnp.asarray(x), jnp.asarray(kernel))
    want = reference.causal_conv1d_fn(torch.tensor(x).transpose(1, 2), torch.tensor(weight[:, 0]))
    np.testing.assert_allclose(out, want.transpose(1, 2).numpy(), atol=1e-6, rtol=0)
    # One more token from the state: transformers' single-step update.
    state = torch.tensor(np.asarray(tail)).transpose(1, 2).contiguous()
    new = rng.normal(size=(2, 1, 5)).astype(np.float32)
    step, _ = causal_conv(jnp.asarray(new), jnp.asarray(kernel), state=tail)
    want_step = reference.causal_conv1d_update(torch.tensor(new).transpose(1, 2), state, torch.tensor(weight[:, 0]))
    np.testing.assert_allclose(step, want_step.transpose(1, 2).numpy(), atol=1e-6, rtol=0)
    runs = document_runs(jnp.asarray(SEGMENTS), 17, 2)
    packed, _ = jax.jit(lambda x: causal_conv(x, jnp.asarray(kernel), runs=runs))(x)
    alone, _ = jax.jit(lambda x: causal_conv(x, jnp.asarray(kernel)))(one_document_a_row({"x": x})["x"])
    for row, (start, stop) in enumerate(DOCUMENTS):
        np.testing.assert_allclose(packed[0, start:stop], alone[row, : stop - start], atol=1e-6, rtol=0)


# A tiny layer: grouped heads (2 key heads, 4 value heads), keys and values of different widths, 3 taps.
LAYER = dict(hidden_size=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=6, linear_conv_kernel_dim=3, rms_norm_eps=1e-6, num_hidden_layers=1,
             layer_types=["linear_attention"], initializer_range=0.2)  # fmt: skip


class LayerConfig:
    """What the layer reads, from a transformers config (functrain's configs answer the same names)."""

    def __init__(self, hf_config, fused: bool, chunk: int) -> None:
        self.__dict__.update({key: getattr(hf_config, key) for key in (*LAYER, "hidden_act")})
        self.fused_linear_projections, self.linear_chunk_size, self.gdn_kernel = fused, chunk, "xla"


def layer_pair(fused: bool, chunk: int = 4) -> tuple[torch.nn.Module, GatedDeltaNet, dict]:
    """transformers' layer (Qwen3-Next's fused projections, or Qwen3.5's) and functrain's with its weights."""
    torch.manual_seed(0)
    if fused:
        hf_config = transformers.Qwen3NextConfig(**LAYER)
        torch_layer = reference.Qwen3NextGatedDeltaNet(hf_config, 0)
    else:
        from transformers.models.qwen3_5 import modeling_qwen3_5

        hf_config = transformers.Qwen3_5TextConfig(**LAYER)
        torch_layer = modeling_qwen3_5.Qwen3_5GatedDeltaNet(hf_config, 0)
    with torch.no_grad():
        for param in torch_layer.parameters():
            param.add_(0.2 * torch.randn_like(param))
    weights = {name: param.detach().numpy() for name, param in torch_layer.named_parameters()}
    params = {"conv1d": {"kernel": weights.pop("conv1d.weight")}, "norm": {"scale": weights.pop("norm.weight")}}
    for name, weight in weights.items():
        module, _, leaf = name.partition(".")
        params[module] = {"kernel": weight.T} if leaf == "weight" else weight
    return torch_layer, GatedDeltaNet(LayerConfig(hf_config, fused, chunk)), {"params": params}


@pytest.mark.parametrize("fused", [True, False], ids=["qwen3_next", "qwen3_5"])
def test_the_layer_matches_transformers_in_output_and_input_gradient(highest_precision, fused):
    torch_layer, layer, params = layer_pair(fused)
    x = np.random.default_rng(4).normal(size=(2, 11, 16)).astype(np.float32)
    mix = 0.1 * np.random.default_rng(5).normal(size=(2, 11, 16)).astype(np.float32)  # gradients of order 1
    hidden = torch.tensor(x, requires_grad=True)
    want = torch_layer(hidden)
    (want * torch.tensor(mix)).sum().backward()

    def weighted(h):
        out = layer.apply(params, h)
        return jnp.sum(out * mix), out

    grad, out = jax.jit(jax.grad(weighted, has_aux=True))(x)
    np.testing.assert_allclose(out, want.detach().numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(grad, hidden.grad.numpy(), atol=ATOL, rtol=0)


def test_decoding_with_the_cache_continues_the_full_forward(highest_precision):
    _, layer, params = layer_pair(fused=False)
    x = jnp.asarray(np.random.default_rng(6).normal(size=(2, 10, 16)).astype(np.float32))
    full = jax.jit(layer.apply)(params, x)
    shapes = jax.eval_shape(lambda: layer.apply(params, x, mutable=["cache"])[1]["cache"])
    assert {name: leaf.shape for name, leaf in shapes.items()} == {"conv_state": (2, 2, 56),
                                                                   "recurrent_state": (2, 4, 8, 6)}
    feed = jax.jit(lambda cache, new: layer.apply({**params, "cache": cache}, new, mutable=["cache"]))
    cache, pieces = zeros_like_shapes(shapes), []
    for start, stop in ((0, 6), (6, 7), (7, 8), (8, 10), (10, 10)):  # a prompt, one token at a time, two at once
        if stop > start:
            out, updated = feed(cache, x[:, start:stop])
            cache = updated["cache"]
            pieces.append(out)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=ATOL, rtol=0)


def test_the_flops_a_plan_counts_hold_every_chunk_s_matmuls():
    inputs = rule_inputs(256, key_heads=1, value_heads=2, widths=(32, 24), batch=1)
    compiled = jax.jit(lambda arrays: chunked_delta_rule(**arrays, chunk_size=32)).lower(inputs).compile()
    counted = step_cost(compiled, steps_per_call=1)["flops"]
    matmuls = 256 * 2 * delta_rule_flops(32, key_dim=32, value_dim=24)  # tokens x value heads x per token and head
    assert matmuls <= counted < 1.3 * matmuls, (counted, matmuls)
    once = compiled.cost_analysis()
    assert (once[0] if isinstance(once, list) else once)["flops"] < 0.7 * counted  # XLA counts the scan's body once


def test_parameters_mirror_transformers_names():
    _, layer, params = layer_pair(fused=True)
    abstract = jax.eval_shape(layer.init, jax.random.PRNGKey(0), jnp.zeros((1, 3, 16)))
    shapes = jax.tree.map(lambda leaf: leaf.shape, nn.meta.unbox(abstract))
    assert shapes == jax.tree.map(np.shape, params)
