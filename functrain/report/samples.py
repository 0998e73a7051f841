"""``eval.samples``: continuations of a prompt written at each evaluation of a language model.

Each evaluation appends ``{"step", "index", "prompt", "text"}`` lines to ``RUN_DIR/samples.jsonl`` and the
texts to TensorBoard (``samples/<index>``); the summary at the end of the run prints the last one. Sample
``i`` at step ``s`` is drawn with seed ``s * 1000 + i``, so a resumed run writes the samples an
uninterrupted one would have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from functrain.callbacks.base import Callback
from functrain.callbacks.view import RunView
from functrain.core.capabilities import backends_with, capabilities_of
from functrain.errors import ConfigError
from functrain.models.configs.base import ModelConfig
from functrain.report.tensorboard import summary_writer

SAMPLES_FILE = "samples.jsonl"


def last_samples(run_dir: str | Path) -> list[dict[str, Any]]:
    """The samples of the newest step in ``RUN_DIR/samples.jsonl`` (none when there are none)."""
    path = Path(run_dir) / SAMPLES_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    newest = max((r.get("step", -1) for r in records), default=-1)
    return [r for r in records if r.get("step") == newest]


def check_language_model_run(model_config: ModelConfig, backend: str, key: str, fix: str) -> None:
    """A one-line ConfigError unless the run trains a built-in causal LM that decodes with a KV cache on JAX,
    which ``key`` (a callback that decodes or scores with the model) needs; ``fix`` says how to turn ``key`` off."""
    from functrain.models import family_names, family_of

    family = family_of(model_config)
    if family is None or not family.generation_cache:
        raise ConfigError(
            f"{key} needs a built-in language model (model.name {', '.join(family_names('generation_cache'))}), "
            f"not {model_config.registry_name() or 'a user model'}; {fix}"
        )
    if not capabilities_of(backend).decodes_in_loop:
        raise ConfigError(f"{key} works with backend: {' or '.join(backends_with('decodes_in_loop'))}; {fix}")


class SampleWriter(Callback):
    """Generates ``eval.samples.count`` continuations of ``eval.samples.prompt`` at each evaluation."""

    def __init__(self, settings: Any, model_config: Any, backend: str, tensorboard: bool) -> None:
        """``settings``: the ``eval.samples`` section; ``model_config``: the run's model section;
        ``tensorboard``: also write the samples as TensorBoard text."""
        from functrain.models import build_model
        from functrain.models.options import for_sampling
        from functrain.text.decode import Generator, load_tokenizer

        check_language_model_run(model_config, backend, "eval.samples", "set eval.samples.count=0")
        self.settings, self.tensorboard = settings, tensorboard
        tokenizer = self.settings.tokenizer
        self.tokenizer = load_tokenizer(tokenizer, "eval.samples.tokenizer") if tokenizer else None
        self.model = build_model(for_sampling(model_config))
        self.generator = Generator(self.model)
        self.writer: Any = None  # a tensorboardX SummaryWriter, opened at the first samples

    def on_evaluate(self, view: RunView, metrics: dict[str, float]) -> None:
        from functrain.models.lora import merged_for_inference
        from functrain.models.stacking import unstack_layers
        from functrain.text.decode import Sampling, decode_tokens, encode_prompt, prepare_prompt

        if view.state is None:
            return
        settings = self.settings
        params = merged_for_inference(view.state.params, self.model.config)  # LoRA: the adapters take part
        params = unstack_layers(params)  # the sampling model is unrolled (model.scan_layers: per-layer cache)
        ids = prepare_prompt(
            encode_prompt(settings.prompt, self.model.config.vocab_size, self.tokenizer),
            self.model.config,
            settings.max_new_tokens,
        )
        records = []
        for index in range(settings.count):
            sampling = Sampling(
                settings.max_new_tokens, settings.temperature, settings.top_k, seed=view.step * 1000 + index
            )
            tokens = self.generator(params, ids[None], sampling)[0]
            records.append(
                {
                    "step": view.step,
                    "index": index,
                    "prompt": settings.prompt,
                    "text": decode_tokens(tokens, self.tokenizer),
                }
            )
        if not view.is_primary:
            return
        with open(view.run_dir / SAMPLES_FILE, "a") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
        if self.tensorboard:
            if self.writer is None:
                self.writer = summary_writer(str(view.run_dir / "tensorboard"), filename_suffix=".samples")
            for record in records:
                self.writer.add_text(f"samples/{record['index']}", record["prompt"] + record["text"], view.step)
            self.writer.flush()

    def on_train_end(self, view: RunView) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
