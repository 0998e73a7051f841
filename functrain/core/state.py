"""The immutable training state: everything a step reads and writes, as one pytree."""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax


class TrainState(flax.struct.PyTreeNode):  # flax.struct.dataclass, with a typed ``replace``
    """Immutable training state.

    ``rng`` is the run's base key: the key of step ``s`` is ``fold_in(rng, s)``, so no random number depends
    on how steps were grouped into compiled calls or on a restart; only ``step`` must be restored.

    Attributes:
      step: int32 scalar, optimizer steps attempted (skipped non-finite steps count too, so the data
        position and the RNG stay in lockstep with it).
      params: model parameters (float32).
      opt_state: optax state.
      rng: raw uint32[2] base key.
      model_state: mutable model collections (e.g. batch statistics); ``{}`` when the model has none.
      loss_scale: float32 scalar; the dynamic loss scale for float16 training (1.0 when unused).
      good_steps: int32 scalar; finite steps since the loss scale last changed.
      skipped_steps: int32 scalar; updates skipped because the loss or gradients were not finite.
      nonfinite_steps: int32 scalar; steps flagged non-finite (as ``skipped_steps`` without dynamic loss
        scaling; with it, only a non-finite loss counts, a routine overflow does not). The loop compares it
        between the calls it reads, so ``train.nonfinite: stop`` sees every incident, also in calls whose
        metrics it never copies.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    model_state: Any
    loss_scale: jax.Array
    good_steps: jax.Array
    skipped_steps: jax.Array
    nonfinite_steps: jax.Array

    @classmethod
    def create(
        cls,
        params: Any,
        tx: optax.GradientTransformation,
        rng: jax.Array,
        model_state: Any = None,
        loss_scale: float = 1.0,
    ) -> "TrainState":
        """A step-0 state with a fresh optimizer state for ``params``."""
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=jnp.asarray(rng, jnp.uint32),
            model_state={} if model_state is None else model_state,
            loss_scale=jnp.asarray(loss_scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            skipped_steps=jnp.zeros((), jnp.int32),
            nonfinite_steps=jnp.zeros((), jnp.int32),
        )

    def step_key(self) -> jax.Array:
        """The RNG key of the current step: ``fold_in(rng, step)``."""
        return jax.random.fold_in(self.rng, self.step)
