"""The supervised tasks, ``classify`` and ``causal_lm``: the built-in losses on data as users have it
(``task.py``)."""

from functrain.tasks.declaration import TaskDeclaration

DECLARATION = TaskDeclaration(names=("classify", "causal_lm"), module="functrain.tasks.supervised.task")
