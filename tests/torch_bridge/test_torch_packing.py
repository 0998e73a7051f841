"""Packed LM batches on backend: torch: one loss policy for both frameworks, attention that stays within a
document for the GPT twin and for transformers models, and a refusal for modules that cannot keep documents
apart."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen as nn
from torch import nn as tnn

from functrain.core import losses as jax_losses
from functrain.errors import ConfigError
from functrain.models.gpt import GPTConfig, build as build_flax_gpt
from functrain.config.load import load_config
from torch_bridge import models
from functrain.run.backends import torch_backend as make_backend
from torch_bridge.user_model import build_module, default_causal_lm_loss, packing_keywords
from torch_bridge.twins import twin_model

REPO = Path(__file__).resolve().parents[2]
LENGTHS = [4, 6, 3]  # three documents packed into one row of 13 tokens (12 inputs)
VOCAB = 40


def _random_lm_batch(rng: np.random.Generator, rows: int = 6, length: int = 11) -> dict[str, np.ndarray]:
    """Token rows with random document boundaries, a token mask and padding rows (weight 0)."""
    starts = rng.random((rows, length)) < 0.25
    starts[:, 0] = True
    segment_ids = np.cumsum(starts, axis=1).astype(np.int32)
    positions = np.zeros((rows, length), np.int32)
    for row in range(rows):
        for col in range(1, length):
            positions[row, col] = 0 if starts[row, col] else positions[row, col - 1] + 1
    weight = np.ones(rows, np.float32)
    weight[-2:] = 0.0
    return {"tokens": rng.integers(0, VOCAB, (rows, length)).astype(np.int32), "weight": weight,
            "mask": (rng.random((rows, length - 1)) > 0.3).astype(np.float32),
            "segment_ids": segment_ids, "positions": positions}


@pytest.mark.parametrize("fields", [("mask", "segment_ids"), ("segment_ids",), ("mask",), ()])
def test_both_frameworks_count_the_same_targets(fields):
    """The JAX and torch losses agree on random batches with segments, masks and padding weights (the policy
    is one definition in functrain.core.losses; this checks both frameworks call it the same way)."""
    rng = np.random.default_rng(len(fields))
    full = _random_lm_batch(rng)
    batch = {k: v for k, v in full.items() if k in ("tokens", "weight", "positions", *fields)}
    logits = rng.normal(size=(*batch["tokens"][:, 1:].shape, VOCAB)).astype(np.float32)
    ours = models.causal_lm_sums(torch.from_numpy(logits), {k: torch.from_numpy(v) for k, v in batch.items()})
    theirs = jax_losses.causal_lm_sums(jnp.asarray(logits), {k: jnp.asarray(v) for k, v in batch.items()})
    for got, want in zip((ours[0], ours[1], ours[2]["accuracy"]), (theirs[0], theirs[1], theirs[2]["accuracy"])):
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    rows, targets = batch["tokens"][:, 1:].shape
    expected_weight = (np.broadcast_to(batch["weight"][:, None], (rows, targets)) * batch.get("mask", 1.0)
                       * (np.diff(batch["segment_ids"], axis=1) == 0 if "segment_ids" in batch else 1.0)).sum()
    assert float(ours[1]) == pytest.approx(expected_weight)


def test_classifier_sums_agree():
    rng = np.random.default_rng(0)
    logits, y = rng.normal(size=(8, 5)).astype(np.float32), rng.integers(0, 5, 8).astype(np.int32)
    weight = np.array([1, 1, 1, 1, 1, 0.5, 0, 0], np.float32)
    ours = models.classifier_sums(torch.from_numpy(logits),
                                  {"y": torch.from_numpy(y), "weight": torch.from_numpy(weight)})
    theirs = jax_losses.classifier_sums(jnp.asarray(logits), {"y": jnp.asarray(y), "weight": jnp.asarray(weight)})
    np.testing.assert_allclose([float(ours[0]), float(ours[1]), float(ours[2]["accuracy"])],
                               [float(theirs[0]), float(theirs[1]), float(theirs[2]["accuracy"])], rtol=1e-6)


def _packed_row(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One packed row of :data:`LENGTHS` documents: tokens, segment ids, positions (each ``[1, 13]``)."""
    tokens = rng.integers(0, VOCAB, sum(LENGTHS)).astype(np.int32)
    segment_ids = np.repeat(np.arange(1, len(LENGTHS) + 1), LENGTHS).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in LENGTHS]).astype(np.int32)
    return tokens[None], segment_ids[None], positions[None]


def _documents_alone(logits_of, tokens: np.ndarray) -> list[np.ndarray]:
    """Each document's logits, run alone as its own one-row batch."""
    starts = np.cumsum([0, *LENGTHS[:-1]])
    return [logits_of(tokens[:, start:start + length]) for start, length in zip(starts, LENGTHS)]


def _split(packed: np.ndarray) -> list[np.ndarray]:
    return np.split(packed, np.cumsum(LENGTHS)[:-1], axis=1)


def test_gpt_twin_keeps_packed_documents_apart_and_matches_flax():
    """Each document's logits in the packed row equal the document run alone, and the Flax GPT's packed logits."""
    config = GPTConfig(vocab_size=VOCAB, max_len=16, d_model=16, n_layers=2, n_heads=2, d_ff=32)
    tokens, segment_ids, positions = _packed_row(np.random.default_rng(1))
    flax_model = build_flax_gpt(config)
    flax_params = nn.meta.unbox(flax_model.init(jax.random.PRNGKey(0), tokens)["params"])
    model = twin_model(config, {}, seed=0)
    model.load_state_dict(models.params_from_flax(flax_params))
    with torch.no_grad():
        packed = model(torch.from_numpy(tokens), segment_ids=torch.from_numpy(segment_ids),
                       positions=torch.from_numpy(positions)).numpy()
        alone = _documents_alone(lambda doc: model(torch.from_numpy(doc)).numpy(), tokens)
    for got, want in zip(_split(packed), alone):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    flax_packed = flax_model.apply({"params": flax_params}, tokens, segment_ids=segment_ids, positions=positions)
    np.testing.assert_allclose(packed, np.asarray(flax_packed), rtol=1e-5, atol=1e-5)


def _tiny_gpt2(attn_implementation: str) -> tnn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        attn_implementation=attn_implementation)
    return build_module(GPT2LMHeadModel, seed=0, config=config).eval()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_transformers_gpt2_keeps_packed_documents_apart(attn_implementation):
    """A transformers GPT-2 on a packed row: through :func:`packing_keywords` each document's logits equal
    the document run alone, and the built-in loss is the sum of the documents' own losses (the targets that
    start a document do not count)."""
    model = _tiny_gpt2(attn_implementation)
    tokens, segment_ids, positions = _packed_row(np.random.default_rng(2))
    packed = {"tokens": tokens, "weight": np.ones(1, np.float32), "segment_ids": segment_ids, "positions": positions}
    # packing_keywords describes tokens[:, :-1]; one more column makes it describe the whole row.
    extended = {key: torch.from_numpy(np.pad(value, ((0, 0), (0, 1)), mode="edge"))
                for key, value in packed.items() if key != "weight"}
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens), **packing_keywords(model, extended)).logits.numpy()
        alone_logits = _documents_alone(lambda doc: model(torch.from_numpy(doc)).logits.numpy(), tokens)
        loss_sum, weight, _ = default_causal_lm_loss(model, {k: torch.from_numpy(v) for k, v in packed.items()}, None)
        alone = [default_causal_lm_loss(model, {"tokens": torch.from_numpy(doc), "weight": torch.ones(1)}, None)
                 for doc in _split(tokens)]
    for got, want in zip(_split(logits), alone_logits):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(weight) == sum(LENGTHS) - len(LENGTHS)  # every target but the documents' first tokens
    assert float(loss_sum) == pytest.approx(sum(float(loss) for loss, _, _ in alone), rel=1e-6)


class _TokensOnly(tnn.Module):
    """A causal LM whose forward takes only the tokens: it cannot keep packed documents apart."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = tnn.Embedding(VOCAB, 8), tnn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def test_a_module_that_cannot_keep_documents_apart_is_refused_before_the_first_step(tmp_path):
    """The backend's probe of the loss on the example batch raises the one-line error at construction."""
    tokens, segment_ids, positions = _packed_row(np.random.default_rng(3))
    example = {"tokens": np.repeat(tokens, 4, 0), "weight": np.ones(4, np.float32),
               "segment_ids": np.repeat(segment_ids, 4, 0), "positions": np.repeat(positions, 4, 0)}
    config = load_config(REPO / "configs" / "mlp_digits_torch.yaml", [f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="_TokensOnly.forward to take attention_mask and position_ids") as error:
        make_backend(config, example, 6, model=_TokensOnly())
    assert "\n" not in str(error.value) and "data.packing=false" in str(error.value)
    unpacked = {key: example[key] for key in ("tokens", "weight")}
    make_backend(config, unpacked, 6, model=_TokensOnly())  # the same module trains on unpacked data
