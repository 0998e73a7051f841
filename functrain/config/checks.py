"""Cross-checks of a config against the run it drives: legal settings that are likely mistakes (warnings) and
metric names that the run never logs (errors, found at the first log of their split).
"""

from __future__ import annotations

from typing import Any

from functrain.errors import ConfigError


def likely_mistakes(config: Any, max_steps: int, has_eval_data: bool) -> list[str]:
    """Warnings for settings that are valid but rarely meant, each naming the key and what to do."""
    warnings = []
    if config.optimizer.warmup_steps >= max_steps:
        warnings.append(
            f"optimizer.warmup_steps={config.optimizer.warmup_steps} is not below the run length of "
            f"{max_steps} steps: the learning rate never reaches optimizer.learning_rate; lower "
            f"warmup_steps"
        )
    for key, every in (
        ("eval.every_steps", config.eval.every_steps),
        ("checkpoint.every_steps", config.checkpoint.every_steps),
        ("log.every_steps", config.log.every_steps),
    ):
        if every > max_steps:
            warnings.append(
                f"{key}={every} is longer than the run ({max_steps} steps): it happens only at the end; lower {key}"
            )
    wants_eval = [
        key
        for key, metric in (
            ("eval.early_stopping_metric", config.eval.early_stopping_metric),
            ("checkpoint.best_metric", config.checkpoint.best_metric if config.checkpoint.keep_best else None),
        )
        if metric and metric.startswith("eval/")
    ]
    for key in wants_eval:
        if not has_eval_data:
            warnings.append(
                f"{key} reads eval metrics but the run has no evaluation data; raise "
                f"data.eval_fraction or give eval data"
            )
        elif not config.eval.every_steps:
            warnings.append(
                f"{key} reads eval metrics but eval.every_steps=0 evaluates only at the end; set eval.every_steps"
            )
    return warnings


def check_metric_logged(key: str, metric: str, split: str, logged: dict[str, float]) -> None:
    """Raise a one-line ConfigError when ``metric`` ("split/name") belongs to ``split`` but is not among the
    names that split logs."""
    metric_split, _, name = metric.partition("/")
    if metric_split == split and name not in logged:
        names = ", ".join(f"{split}/{logged_name}" for logged_name in sorted(logged))
        raise ConfigError(f"{key}={metric!r} is not a metric this run logs; choose one of {names}")
