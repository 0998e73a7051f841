"""The supervised tasks, ``classify`` and ``causal_lm``: the built-in losses on data as users have it
(``task.py``)."""
