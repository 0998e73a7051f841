"""The distillation losses against TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` on the same logits, and the
mix with the hard-label cross-entropy as sums over the tokens the causal-LM loss counts."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from functrain.core.losses import causal_lm_sums
from functrain.tasks.distill.loss import distill_sums, token_divergence

BATCH, LENGTH, VOCAB = 3, 7, 11


@pytest.fixture(scope="module")
def trl_jsd():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL warns that trl.experimental may change
    from trl.experimental.gkd import GKDTrainer
    return GKDTrainer.generalized_jsd_loss


def random_case(masked: bool, seed: int = 0):
    """Student and teacher logits ``[B, L, V]`` (standard normal, as a model's are), the batch they belong to
    (``tokens``/``labels`` of length L + 1) and TRL's shifted labels ``[B, L]``."""
    rng = np.random.default_rng(seed)
    student = rng.standard_normal((BATCH, LENGTH, VOCAB)).astype(np.float32)
    teacher = rng.standard_normal((BATCH, LENGTH, VOCAB)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
    labels = tokens.copy()
    if masked:  # a prompt of 0..3 tokens per row, and a row whose targets are all masked
        for row, prompt in enumerate((2, 4, LENGTH + 1)):
            labels[row, :prompt] = -100
    batch = {"tokens": tokens, "labels": labels, "weight": np.ones(BATCH, np.float32)}
    return student, teacher, batch, labels[:, 1:]


def ours(student, teacher, batch, **settings):
    """Our divergence reduced as TRL's ``batchmean`` with labels: the sum over counted tokens / their count."""
    loss_sum, count, aux = distill_sums(jnp.asarray(student), jnp.asarray(teacher), batch, alpha=1.0, **settings)
    return float(loss_sum / count), float(aux["distill"] / count)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_equals_trl_generalized_jsd_loss(trl_jsd, beta, temperature, masked):
    student, teacher, batch, trl_labels = random_case(masked)
    expected = float(trl_jsd(torch.from_numpy(student), torch.from_numpy(teacher), labels=torch.from_numpy(trl_labels),
                             beta=beta, temperature=temperature, reduction="batchmean"))
    loss, distill = ours(student, teacher, batch, loss="jsd", beta=beta, temperature=temperature)
    assert abs(loss - expected) < 1e-6 and loss == distill
    assert expected > 0.02  # the distributions differ: the case is not degenerate


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gradient_equals_trl(trl_jsd, beta, temperature):
    student, teacher, batch, trl_labels = random_case(masked=True, seed=1)
    student_t = torch.from_numpy(student).requires_grad_(True)
    trl_jsd(student_t, torch.from_numpy(teacher), labels=torch.from_numpy(trl_labels), beta=beta,
            temperature=temperature, reduction="batchmean").backward()

    def loss(logits):
        loss_sum, count, _ = distill_sums(logits, jnp.asarray(teacher), batch, loss="jsd", beta=beta,
                                          temperature=temperature, alpha=1.0)
        return loss_sum / count
    grads = np.asarray(jax.grad(loss)(jnp.asarray(student)))
    np.testing.assert_allclose(grads, student_t.grad.numpy(), atol=1e-6, rtol=0)
    assert np.abs(grads).max() > 1e-3


def test_unmasked_sum_equals_trl_sum(trl_jsd):
    """Without labels every target counts: our sum is TRL's ``reduction="sum"``."""
    student, teacher, batch, _ = random_case(masked=False, seed=2)
    del batch["labels"]
    expected = float(trl_jsd(torch.from_numpy(student), torch.from_numpy(teacher), beta=0.5, temperature=2.0,
                             reduction="sum"))
    _, _, aux = distill_sums(jnp.asarray(student), jnp.asarray(teacher), batch, loss="jsd", beta=0.5,
                             temperature=2.0, alpha=0.3)
    assert abs(float(aux["distill"]) - expected) < 1e-5 * expected


@pytest.mark.parametrize("loss, beta", [("forward_kl", 0.0), ("reverse_kl", 1.0)])
def test_kl_losses_are_jsd_limits(loss, beta):
    student, teacher, _, _ = random_case(masked=False)
    named = token_divergence(student, teacher, loss=loss, beta=0.5, temperature=1.5)
    limit = token_divergence(student, teacher, loss="jsd", beta=beta, temperature=1.5)
    np.testing.assert_array_equal(np.asarray(named), np.asarray(limit))
    assert float(named.min()) > 0


def test_forward_kl_is_kl_teacher_student():
    student, teacher, _, _ = random_case(masked=False)
    p = jax.nn.softmax(teacher, axis=-1)
    expected = np.sum(p * (jax.nn.log_softmax(teacher, axis=-1) - jax.nn.log_softmax(student, axis=-1)), axis=-1)
    np.testing.assert_allclose(np.asarray(token_divergence(student, teacher, loss="forward_kl", beta=0.5,
                                                           temperature=1.0)), expected, rtol=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 0.25, 1.0])
def test_alpha_mixes_distillation_and_cross_entropy_sums(alpha):
    student, teacher, batch, _ = random_case(masked=True)
    loss_sum, count, aux = distill_sums(jnp.asarray(student), jnp.asarray(teacher), batch, loss="reverse_kl",
                                        beta=0.5, temperature=1.0, alpha=alpha)
    ce_sum, ce_count, ce_aux = causal_lm_sums(jnp.asarray(student), batch)
    assert float(count) == float(ce_count) == float((batch["labels"][:, 1:] != -100).sum())
    assert float(aux["cross_entropy"]) == float(ce_sum) and float(aux["accuracy"]) == float(ce_aux["accuracy"])
    np.testing.assert_allclose(float(loss_sum), alpha * float(aux["distill"]) + (1 - alpha) * float(ce_sum),
                               rtol=1e-6)


def test_padding_and_segment_starts_do_not_count():
    """Tokens count where the hard-label loss counts them: a padding row (weight 0) and the first target of a
    packed segment add nothing to the distillation sum."""
    student, teacher, batch, _ = random_case(masked=False)
    del batch["labels"]
    batch["weight"] = np.array([1, 1, 0], np.float32)
    batch["segment_ids"] = np.repeat(np.array([[1] * 4 + [2] * (LENGTH - 3)]), BATCH, axis=0).astype(np.int32)
    per_token = np.asarray(token_divergence(student, teacher, loss="forward_kl", beta=0.5, temperature=1.0))
    counted = np.ones((BATCH, LENGTH), np.float32)
    counted[2] = 0
    counted[:, 3] = 0  # target 4 starts segment 2
    _, count, aux = distill_sums(jnp.asarray(student), jnp.asarray(teacher), batch, loss="forward_kl", beta=0.5,
                                 temperature=1.0, alpha=1.0)
    assert float(count) == counted.sum()
    np.testing.assert_allclose(float(aux["distill"]), (per_token * counted).sum(), rtol=1e-6)
