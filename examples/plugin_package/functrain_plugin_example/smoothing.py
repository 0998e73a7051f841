"""``task: smoothed_classify``: a classifier trained with label smoothing, the task's section and its declaration.

Light, like functrain's own task folders' ``__init__.py`` (pydantic only): functrain reads this declaration when it
lists its tasks, and imports the task's code (``functrain_plugin_example.smoothing_task``) only for a run that
trains it.
"""

from pydantic import Field

from functrain.core.section import TaskSection
from functrain.tasks.declaration import Panel, TaskDeclaration


class SmoothingConfig(TaskSection):
    """``smoothed_classify.smoothing``: the share of each label's probability spread over the other classes."""

    smoothing: float = Field(0.1, ge=0.0, lt=1.0)


DECLARATION = TaskDeclaration(
    names=("smoothed_classify",),
    module="functrain_plugin_example.smoothing_task",
    section=SmoothingConfig,
    panels=(Panel("hard-label loss", "cross-entropy", "hard_loss", with_eval=True),),
    summary=(("hard_loss", "min"),),
)
