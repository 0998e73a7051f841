"""The GRPO task (``task: grpo``, implied by ``data.name: prompts``): reinforcement learning from rewards, with
GRPO and its variants (DAPO, Dr. GRPO, GSPO) as TRL 1.16 defines them.

The folder holds the whole mode: ``config.py`` (the ``grpo`` section, TRL's names), ``prompts.py`` (a JSONL of
prompts, tokenised as TRL does), ``rewards.py`` (reward functions: import paths with TRL's signature, and the
built-ins), ``advantages.py`` (group-normalised advantages and the reward metrics, on the host), ``loss.py`` (the
clipped policy loss, its reductions and metrics, as sums), ``rollout.py`` (the experience stage: completions
sampled in-process with the current weights), ``environment.py`` and ``episodes.py`` (multi-turn episodes with an
environment: its API and checked calls, and the turns sampled against it) and ``task.py`` (the task).
"""

from functrain.tasks.declaration import Panel, TaskDeclaration
from functrain.tasks.grpo.config import GRPOConfig

DECLARATION = TaskDeclaration(
    names=("grpo",),
    module="functrain.tasks.grpo.task",
    section=GRPOConfig,
    panels=(Panel("reward", "mean reward", "reward"), Panel("KL to the reference", "kl", "kl")),
)
