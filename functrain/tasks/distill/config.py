"""``distill.*``: the section of a ``task: distill`` run (pydantic only, so reading a config stays cheap)."""

from typing import Literal

from pydantic import Field

from functrain.core.section import TaskSection


class DistillConfig(TaskSection):
    """``distill.*``: distil a frozen teacher into the model being trained (the student).

    ``teacher`` (required by the task; None only as the section's default): a functrain run directory (its newest
    whole checkpoint, or ``teacher_step``) or an HF checkpoint directory (config.json + safetensors), of any
    registered causal-LM architecture with the student's vocabulary.
    ``loss``: ``forward_kl`` (KL(teacher || student)), ``reverse_kl`` (KL(student || teacher)) or ``jsd`` (TRL's
    generalized Jensen-Shannon divergence, ``beta`` the teacher's weight in the mixture; 0 and 1 are forward and
    reverse KL). ``temperature`` divides both models' logits in the divergence. ``alpha`` is the weight of the
    divergence; ``1 - alpha`` that of the student's hard-label cross-entropy.
    ``lmbda``: GKD's share of on-policy steps (TRL's name): a step is on-policy with this probability, drawn from
    the run's seed and the step, and then the last ``max_new_tokens`` tokens of each window are the student's own
    continuation of the tokens before it, sampled at ``temperature`` (0: the data's text only)."""

    teacher: str | None = None
    teacher_step: int | None = Field(None, ge=0)
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    beta: float = Field(0.5, ge=0.0, le=1.0)
    temperature: float = Field(1.0, gt=0.0)
    alpha: float = Field(0.5, ge=0.0, le=1.0)
    lmbda: float = Field(0.0, ge=0.0, le=1.0)
    max_new_tokens: int = Field(16, ge=1)
