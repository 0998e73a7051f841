"""The distillation task (``task: distill``): a student learns from a frozen teacher's next-token distributions.

The folder holds the whole mode: ``config.py`` (the ``distill`` section), ``loss.py`` (forward and reverse KL,
TRL's generalized JSD, mixed with the hard-label cross-entropy, as sums), ``teacher.py`` (the teacher from a run
directory or an HF directory) and ``task.py`` (the task: causal-LM data, the program with the teacher's frozen
forward, the start hook that loads the teacher's weights).
"""

from functrain.tasks.declaration import TaskDeclaration
from functrain.tasks.distill.config import DistillConfig

DECLARATION = TaskDeclaration(names=("distill",), module="functrain.tasks.distill.task", section=DistillConfig)
