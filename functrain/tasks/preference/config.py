"""The ``preference`` section: the loss of a preference run and how its pairs are cut and referenced."""

from typing import Any, Literal

from pydantic import Field

from functrain.core.section import TaskSection


class PreferenceConfig(TaskSection):
    """``preference.*``: the loss of a ``task: preference`` run (implied by ``data.name: preference``), with TRL's
    names (see :mod:`functrain.tasks.preference.loss`): ``loss_type`` (DPO ``sigmoid``, ``ipo``, ``hinge``,
    ``robust``; the reference-free ``simpo`` and ``orpo``), ``beta`` (ORPO's lambda too), ``label_smoothing``
    (``robust``, ``simpo``), ``simpo_gamma``; ``truncation_mode`` (``keep_start`` / ``keep_end``) cuts a pair longer
    than ``data.seq_len`` tokens as TRL does (None: such a pair is refused); ``init_from``: the former name of
    ``train.init_from`` (kept as an alias); ``precompute_ref``: compute the reference's log-probs of every pair
    once before the first step, save them beside the run (``reference_logps.npz``) and hold no reference in the
    step (TRL's ``precompute_ref_log_probs``)."""

    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"] = "sigmoid"
    beta: float = Field(0.1, gt=0.0)
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    simpo_gamma: float = 0.5
    truncation_mode: Literal["keep_start", "keep_end"] | None = None
    init_from: str | None = None
    precompute_ref: bool = False

    @classmethod
    def implied_by(cls, config: Any) -> bool:
        """``data.name: preference`` (a JSONL of pairs at ``data.path``) trains preferences."""
        data = config.data
        return data.name == "preference" and data.target is None and data.sources is None

    def aliases(self) -> dict[str, tuple[str, object]]:
        return {"train.init_from": ("init_from", self.init_from)} if self.init_from else {}
