"""Rewards -> advantages and the reward metrics, on the host, as TRL 1.16's ``GRPOTrainer`` computes them
(``multi_objective_aggregation: sum_then_normalize``, float32).

A completion's reward is the weighted sum of its reward functions' values (a function's None counts 0; a
completion no function scored is left out of every statistic and gets advantage 0). Its advantage is the reward
minus its group's mean (the ``num_generations`` completions of its prompt), divided by ``std + 1e-4`` where std is
the group's (``scale_rewards: group``) or the whole batch's (``batch``) standard deviation (Bessel-corrected), or
not divided (``none``; the group's std still decides ``frac_reward_zero_std``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import numpy as np

STD_EPSILON = 1e-4  # TRL's


@contextlib.contextmanager
def _quiet_nanmean() -> Iterator[None]:
    """A group or function with no scored completion has a NaN mean and std, as in TRL: no warning for it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def nanstd(values: np.ndarray, axis: int | None = None) -> np.ndarray:
    """The standard deviation ignoring NaNs, Bessel-corrected (NaN with fewer than two values), as TRL's."""
    mean = np.nanmean(values, axis=axis, keepdims=True)
    variance = np.nanmean((values - mean) ** 2, axis=axis, keepdims=True)
    count = np.sum(~np.isnan(values), axis=axis, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        variance = variance * np.where(count > 1, count / (count - 1), np.nan).astype(values.dtype)
    std = np.sqrt(variance).astype(values.dtype)
    return std.reshape(()) if axis is None else np.squeeze(std, axis=axis)


def weighted_rewards(table: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Each completion's reward ``[B]``: its functions' values ``table`` ``[B, F]`` (NaN: not scored) weighted and
    summed; NaN where no function scored it."""
    rewards = np.nansum(table * weights[None, :], axis=1).astype(np.float32)
    rewards[np.isnan(table).all(axis=1)] = np.nan
    return rewards


def group_advantages(
    table: np.ndarray, weights: np.ndarray, generations: int, scale_rewards: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(advantages, is_std_zero)`` ``[B]`` of the rewards ``table`` ``[B, F]`` of groups of ``generations``
    consecutive completions."""
    rewards = weighted_rewards(table, weights)
    grouped = rewards.reshape(-1, generations)
    with _quiet_nanmean():
        mean = np.repeat(np.nanmean(grouped, axis=1), generations)
        if scale_rewards == "batch":
            std = np.full_like(rewards, nanstd(rewards))
        else:
            std = np.repeat(nanstd(grouped, axis=1), generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + np.float32(STD_EPSILON))
    is_std_zero = np.isclose(std, 0.0, rtol=1.3e-6, atol=1e-5)  # torch.isclose's float32 tolerances
    return np.nan_to_num(advantages, nan=0.0).astype(np.float32), is_std_zero


def reward_metrics(table: np.ndarray, weights: np.ndarray, names: list[str]) -> dict[str, float]:
    """``reward``, ``reward_std`` and ``rewards/<name>/mean|std`` (TRL's names) of the rewards ``table``."""
    rewards = weighted_rewards(table, weights)
    with _quiet_nanmean():
        metrics = {"reward": float(np.nanmean(rewards)), "reward_std": float(nanstd(rewards))}
        for column, name in enumerate(names):
            metrics[f"rewards/{name}/mean"] = float(np.nanmean(table[:, column]))
            metrics[f"rewards/{name}/std"] = float(nanstd(table[:, column]))
    return metrics
