"""``eval.harness_tasks``: lm-evaluation-harness tasks scored at each evaluation of a language-model run.

At every evaluation the current params (LoRA adapters merged in) are scored in this process, with no
checkpoint reload, by lm-eval's ``functrain`` model (:mod:`functrain.text.harness`); the scores are logged under
the ``harness`` split as ``harness/<task>/<metric>`` (metrics.jsonl, TensorBoard, trackers, plot), so
``eval.early_stopping_metric`` and ``checkpoint.best_metric`` may name them. The tasks are looked up when the
run is built: a task that does not exist stops the run before its first step.
"""

from __future__ import annotations

from typing import Any

from functrain.callbacks.base import Callback, Control
from functrain.callbacks.view import RunView
from functrain.report.samples import check_language_model_run

HARNESS_SPLIT = "harness"


class HarnessEvaluation(Callback):
    """Scores lm-eval ``tasks`` on the run's current params at each evaluation."""

    def __init__(
        self,
        tasks: list[str],
        include_path: str | None,
        limit: int | None,
        batch_size: int,
        tokenizer: str | None,
        model_config: Any,
        backend: str,
    ) -> None:
        """``model_config``: the run's model section (a built-in causal LM); ``backend``: the run's (jax)."""
        from functrain.models import build_model
        from functrain.models.options import for_sampling

        check_language_model_run(model_config, backend, "eval.harness_tasks", "remove eval.harness_tasks")
        from functrain.text.decode import load_tokenizer
        from functrain.text.harness import FunctrainLM, task_manager

        self.tasks, self.limit = list(tasks), limit
        self.manager = task_manager(self.tasks, include_path, where="eval.harness_tasks")
        self.model = build_model(for_sampling(model_config))
        tokenizer_object = load_tokenizer(tokenizer, "eval.harness_tokenizer") if tokenizer else None
        self.lm = FunctrainLM.from_params(self.model, None, tokenizer_object, batch_size)  # params: each evaluation's

    def on_evaluate(self, view: RunView, metrics: dict[str, float]) -> Control | None:
        from functrain.models.lora import merged_for_inference
        from functrain.text.harness import task_scores

        if view.state is None:
            return None
        self.lm.params = merged_for_inference(view.state.params, self.model.config)
        try:
            scores = task_scores(self.lm, self.tasks, self.manager, limit=self.limit)
        finally:
            self.lm.params = None  # the state is donated to the next call
        return Control(metrics={HARNESS_SPLIT: scores})
