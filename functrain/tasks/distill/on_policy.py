"""On-policy distillation (GKD's ``lmbda``): the experience stage that makes a step's windows end in the student's
own text.

A step is on-policy with probability ``distill.lmbda``, drawn from the step's key (so which steps are, and what
they sample, is a function of the run's seed and the step: a resumed run stays bitwise). On such a step the last
``distill.max_new_tokens`` tokens of every window are replaced by the student's continuation of the tokens before
them, sampled in-process at ``distill.temperature`` with the step's weights
(:class:`functrain.tasks.sampling.Sampler`); the teacher then scores the student's text, and the loss is the
task's own over the whole window. Other steps train on the data as it is.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from functrain.errors import ConfigError
from functrain.tasks.sampling import Sampler


class OnPolicy:
    """The experience stage (:class:`functrain.tasks.base.ExperienceStage`) of a distillation run with ``lmbda``
    above 0: ``field`` holds the token windows ``[B, L+1]``."""

    across_processes = True  # each process continues its own windows; nothing is computed over the whole batch

    def __init__(self, sampler: Sampler, field: str, lmbda: float, new_tokens: int) -> None:
        self.sampler, self.field, self.lmbda, self.new_tokens = sampler, field, lmbda, new_tokens

    def __call__(self, params: Any, batch: dict[str, Any], key: jax.Array, step: int) -> dict[str, Any]:
        coin, sampling = jax.random.split(key)
        if float(jax.device_get(jax.random.uniform(coin))) >= self.lmbda:
            return batch
        windows = np.asarray(batch[self.field])
        keep = windows.shape[1] - self.new_tokens
        if keep < 1:
            raise ConfigError(
                f"distill.max_new_tokens={self.new_tokens} leaves no prompt in windows of {windows.shape[1]} tokens; "
                f"lower distill.max_new_tokens below {windows.shape[1]}"
            )
        prompts = np.ascontiguousarray(windows[:, :keep], np.int32)
        lengths = np.full(len(windows), keep, np.int32)
        generated, _ = self.sampler.sample(params, prompts, lengths, sampling, prefill=keep)  # this process's rows
        return {**batch, self.field: np.concatenate([windows[:, :keep], generated.astype(windows.dtype)], 1)}
