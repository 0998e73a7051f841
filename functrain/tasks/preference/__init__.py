"""The preference task (``task: preference``, implied by ``data.name: preference``): DPO and its variants.

The folder holds the whole mode: ``config.py`` (the ``preference`` section), ``pairs.py`` (a JSONL of pairs
tokenised as TRL does), ``loss.py`` (TRL's losses on sequence log-probs, and the Program with its reference),
``reference.py`` (``preference.precompute_ref``: the reference's log-probs computed once, a start hook) and
``task.py`` (the task: its data, program and hooks).
"""

from functrain.tasks.declaration import Panel, TaskDeclaration
from functrain.tasks.preference.config import PreferenceConfig

DECLARATION = TaskDeclaration(
    names=("preference",),
    module="functrain.tasks.preference.task",
    section=PreferenceConfig,
    panels=(
        Panel("reward margin", "rewards/margins", "rewards/margins", with_eval=True),
        Panel("reward accuracy", "rewards/accuracies", "rewards/accuracies", with_eval=True),
    ),
    summary=(("rewards/margins", "max"), ("rewards/accuracies", "max")),
)
