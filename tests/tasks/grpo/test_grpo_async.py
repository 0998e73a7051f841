"""Asynchronous GRPO (``grpo.async_steps``): batches sampled ahead with older weights, the truncated
importance-sampling correction and its metrics, and a run cut at a save resuming bitwise from the batches its
checkpoint holds."""

import jax.numpy as jnp
import numpy as np
import pytest

from functrain.checkpoint.layout import CHECKPOINTS_SUBDIR, EXPERIENCE, step_dir
from functrain.run.fit import fit
from functrain.tasks.grpo.loss import LossSettings, grpo_sums, truncated_is_ratio
from tests.tasks.grpo.test_grpo_run import _same_training, config, train_lines, workspace  # noqa: F401

AHEAD = {"grpo.async_steps": 2}


def test_the_ratio_to_the_sampler_is_truncated_at_the_cap_and_weighs_the_policy_loss():
    logps = jnp.log(jnp.array([[0.5, 0.2, 0.4, 0.3]]))
    drawn = jnp.log(jnp.array([[1.0, 0.1, 0.1, np.nan]]))  # ratios 0.5, 2, 4 (above the cap 3); one not drawn
    batch = {"sampler_logps": drawn, "completion_mask": jnp.array([[0, 1, 1, 1, 0]]), "advantages": jnp.array([1.0]),
             "batch_rows": jnp.array([1.0]), "batch_tokens": jnp.array([3.0])}
    ratio, truncated = truncated_is_ratio(batch, logps, 3.0)
    np.testing.assert_allclose(ratio, [[0.5, 2.0, 3.0, 1.0]], rtol=1e-6)
    assert truncated.tolist() == [[0.0, 0.0, 1.0, 0.0]]
    settings = LossSettings(loss_type="dapo", is_cap=3.0)
    plain = grpo_sums(settings, logps, logps, logps, None, batch)
    weighted = grpo_sums(settings, logps, logps, logps, None, batch, (ratio, truncated))
    # The ratio to the old policy is 1, so each token's loss is -A: weighted, -(0.5 + 2 + 3) on the mask's 3 tokens.
    assert float(plain[0]) == -3.0 and float(weighted[0]) == pytest.approx(-5.5)
    assert float(weighted[2]["rollout/is_ratio_mean"]) == pytest.approx(5.5)  # sums: the step divides by 3 tokens
    assert float(weighted[2]["rollout/is_clipped_frac"]) == pytest.approx(1.0)
    assert "rollout/is_ratio_mean" not in plain[2]


@pytest.fixture(scope="module")
def ahead_run(workspace):  # noqa: F811
    """Four steps sampled two steps ahead, uninterrupted."""
    run_dir = workspace / "ahead"
    fit({}, **config(workspace, run_dir, **AHEAD))
    return run_dir


def test_batches_sampled_ahead_log_their_staleness_and_importance_weights(ahead_run):
    lines = train_lines(ahead_run)
    # The pipeline starts at step 1 (index 0): the batches of steps 2 and 3 sampled with its weights, then two old.
    assert [line["rollout/staleness"] for line in lines] == [1.0, 2.0]
    for line in lines:
        assert 0.5 < line["rollout/is_ratio_mean"] < 2 and 0.0 <= line["rollout/is_clipped_frac"] < 0.5
        assert line["rollout/logprob_gap"] > 1e-3  # sampled with older weights than the step's
    assert (step_dir(ahead_run / CHECKPOINTS_SUBDIR, 2) / EXPERIENCE).is_dir()


def test_an_async_run_cut_at_a_save_resumes_bitwise_from_the_batches_its_checkpoint_holds(
        workspace, ahead_run, tmp_path):  # noqa: F811
    fit({}, **config(workspace, tmp_path / "cut", **AHEAD, **{"train.max_steps": 2}))
    fit({}, **config(workspace, tmp_path / "cut", **AHEAD))  # resumes at step 2 with steps 3 and 4's batches
    _same_training(tmp_path / "cut", ahead_run)
