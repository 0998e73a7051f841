"""The base of every typed config section (the run's, a task's, a model family's)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, values are validated on assignment too, and no number is
    infinite or NaN (``optimizer.learning_rate=inf`` would train to NaN)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class TaskSection(Section):
    """The config section of a task (:mod:`functrain.tasks`), named after it."""

    @classmethod
    def implied_by(cls, config: object) -> bool:
        """Whether a config that names no ``task`` trains this one (its data says so); False by default."""
        return False

    def aliases(self) -> dict[str, tuple[str, object]]:
        """Keys of this section that moved elsewhere, as ``{"section.key": (own key, value)}`` for those given
        (the run config applies them where the key lives now)."""
        return {}
