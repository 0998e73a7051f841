"""Asynchronous GRPO (``grpo.async_steps: k``): the batches of the next k steps, sampled while a step trains.

At step ``s`` the experience stage samples the batch of step ``s + k`` from the loader's prompts of step ``s``, with
the weights of step ``s``, while the step trains on the batch sampled k steps earlier: a step's batch is sampled with
weights ``k`` steps old (``rollout/staleness``), corrected by the loss's truncated importance-sampling ratio
(:mod:`functrain.tasks.grpo.loss`). Where the pipeline starts (a fresh run, or a checkpoint without batches made
ahead) the batch of step ``s`` is sampled first, synchronously, then those of ``s + 1`` to ``s + k`` from the same
prompts (each with its own key): the staleness rises from 0 to k over the first k steps, and the first step's
prompts are trained ``k + 1`` times. The key of the batch step ``t`` trains is ``t``'s, as in a synchronous run.

One process, the same devices, interleaved: the JAX backend (:meth:`functrain.run.jax_backend.JaxBackend`) copies
the step's weights for the sampler, dispatches the step (JAX dispatch is asynchronous: the call returns at once),
then samples and scores the batch of ``s + k`` on the copy. So the host's work (waiting for the sampler's tokens,
decoding them, the reward functions, the environment's turns, the batch's layout) runs while the devices train,
and the devices always have the next program queued. On an accelerator, whose programs run one after another, the
sampler's and the step's device time add up: what overlaps is the host's work. On the CPU the sampler (one thread)
and the step (XLA's pool) may also run at once on a host with cores to spare. No thread is started: the reward
functions and environments are called on the main thread, one generation after the other, and need not be
thread-safe.

The batches made ahead are part of the checkpoint (:meth:`InFlight.saved`, the checkpoint's ``experience`` item): a
run cut at a save resumes from them bitwise equal to one that never stopped. ``async_steps`` cannot change across a
resume that restores them (the checkpoint holds k batches): a checkpoint of a synchronous run resumes asynchronously
(the pipeline starts there), an asynchronous one synchronously (the batches made ahead are not read).
"""

from __future__ import annotations

import numpy as np

# The field of a checkpointed batch made ahead holding the prompt and completion tokens of its generation (TRL's
# num_tokens counts them once the batch trains), the same on every row.
TOKENS = "generation_tokens"


class InFlight:
    """The batches made ahead, by the step that trains each, with the tokens of their generation; ``steps``: k."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._batches: dict[int, tuple[dict[str, np.ndarray], int]] = {}

    def missing(self, step: int) -> list[int]:
        """The steps after ``step``, up to ``step + k``, whose batches are not made yet."""
        return [target for target in range(step + 1, step + self.steps + 1) if target not in self._batches]

    def put(self, step: int, batch: dict[str, np.ndarray], tokens: int) -> None:
        """Keep the batch made for ``step`` and its generation's token count."""
        self._batches[step] = (batch, tokens)

    def take(self, step: int) -> tuple[dict[str, np.ndarray], int] | None:
        """The batch made for ``step`` and its token count, handed over once (None: none was made)."""
        return self._batches.pop(step, None)

    def saved(self) -> list[dict[str, np.ndarray]]:
        """The k batches made ahead in the order of their steps, their token counts as :data:`TOKENS`; none before
        the first step (the pipeline has not started)."""
        if len(self._batches) < self.steps:
            return []
        return [
            {**batch, TOKENS: np.full(len(batch["advantages"]), tokens, np.int32)}
            for _, (batch, tokens) in sorted(self._batches.items())
        ]

    def restore(self, step: int, saved: list[dict[str, np.ndarray]]) -> None:
        """Hold the batches :meth:`saved` wrote for the steps from ``step`` on (a resumed run's)."""
        self._batches = {
            step + offset: ({name: value for name, value in batch.items() if name != TOKENS}, int(batch[TOKENS][0]))
            for offset, batch in enumerate(saved)
        }
