"""The ``functrain`` model of lm-evaluation-harness: a run's checkpoint (or the params in hand) scored and
sampled as lm-eval's own ``hf`` model scores and samples a transformers model.

Importing this module registers the class under the name ``functrain`` with lm-eval's model registry, so that::

    import functrain.text.harness  # noqa: F401 (registers "functrain")
    lm_eval.simple_evaluate(model="functrain", model_args="run=RUN_DIR,step=N,tokenizer=PATH", tasks=[...])

evaluates a run. Text becomes token ids with the run's tokenizer (an HF tokenizer directory, as
``functrain generate --tokenizer``) or UTF-8 bytes by default (token id = byte, EOS = byte 0).

- ``loglikelihood``: requests sorted longest first (lm-eval's ``Collator``), ``batch_size`` per forward, each
  row right-padded to a bucket of lengths (powers of two up to the context, so few shapes compile), fp32
  log-softmax; the context is cut from the left when context + continuation exceed the model's context,
  and ``is_greedy`` is true when every continuation token is the argmax, as in lm-eval's ``hf`` model.
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows over the context length, scored as above.
- ``generate_until``: the jitted KV-cache decoder of :mod:`functrain.text.decode`, greedy unless the task
  samples (``do_sample``, ``temperature``, ``top_k``), ``max_gen_toks`` new tokens, cut at the first EOS token
  and at the first ``until`` string. Prompts of different lengths share a batch (``Generator.ragged``: each
  row's prompt tokens are fed until it ends, so no padding is attended to); the context is cut from the left
  to leave room for ``max_gen_toks``.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functrain.core.model_output import logits_of
from functrain.errors import ConfigError, DataError

try:
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        Collator,
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
except ImportError as exc:
    raise ConfigError(f"lm-evaluation-harness is not installed ({exc}); pip install 'functrain[eval]'") from None

from functrain.text.decode import Generator, Sampling, load_language_model, load_tokenizer
from functrain.text.tokenizer import BYTE_EOS

log = logging.getLogger("functrain")

DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf model's default, lowered to half the context for short models
SHORTEST_BUCKET = 16
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "until", "max_gen_toks")


def _bucket(length: int, context: int) -> int:
    """The padded length a row of ``length`` tokens is scored at: the next power of two, at most ``context``."""
    return min(context, max(SHORTEST_BUCKET, 1 << (length - 1).bit_length()))


def _token_scores(model: Any, params: Any, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per position: the fp32 log-probability of the target token, and whether it is the argmax."""
    logits = logits_of(model.apply({"params": params}, inputs)).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


class _Bytes:
    """The byte fallback: text is its UTF-8 bytes (``data.name: char_text``), EOS and prefix are byte 0."""

    name = "bytes"
    eos_token_id = bos_token_id = BYTE_EOS

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids: list[int]) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


@register_model("functrain")
class FunctrainLM(TemplateLM):
    """A functrain causal LM as an lm-eval model (see the module docstring).

    ``FunctrainLM(run=RUN_DIR, step=None, tokenizer=None, batch_size=16)`` loads a run's checkpoint (the
    newest whole one by default); :meth:`from_params` wraps a model and params already in memory (the
    training loop's evaluation callback)."""

    run_dir: str | None  # None: made by from_params
    step: int | None

    def __init__(
        self,
        run: str | os.PathLike | None = None,
        step: int | str | None = None,
        tokenizer: str | None = None,
        batch_size: int | str | None = None,
        max_gen_toks: int | None = None,
        **ignored: Any,
    ) -> None:
        """``ignored``: what ``simple_evaluate`` passes every model (``device``, ``max_batch_size``): a JAX model
        runs on JAX's devices."""
        super().__init__()
        if run is None:
            raise ConfigError("the functrain lm-eval model needs model_args run=RUN_DIR (a functrain run directory)")
        model, params, loaded_step = load_language_model(run, None if step in (None, "") else int(step))
        self._setup(model, params, load_tokenizer(tokenizer) if tokenizer else None, batch_size, max_gen_toks)
        self.run_dir, self.step = str(run), loaded_step

    @classmethod
    def from_params(
        cls,
        model: Any,
        params: Any,
        tokenizer: Any = None,
        batch_size: int | None = None,
        max_gen_toks: int | None = None,
    ) -> FunctrainLM:
        """An lm-eval model of a Flax causal LM (built for sampling) and its params, with an HF tokenizer
        object (None: UTF-8 bytes)."""
        self = cls.__new__(cls)
        TemplateLM.__init__(self)
        self._setup(model, params, tokenizer, batch_size, max_gen_toks)
        self.run_dir, self.step = None, None
        return self

    def _setup(
        self, model: Any, params: Any, tokenizer: Any, batch_size: int | str | None, max_gen_toks: int | None
    ) -> None:
        self.model, self.params = model, params
        self.vocab_size = int(model.config.vocab_size)
        self._max_length = model.config.max_positions() or 2048  # lm-eval's default for a model without one
        self.hf_tokenizer = tokenizer
        if batch_size in (None, "") or str(batch_size).startswith("auto"):  # lm-eval's "auto": our default
            batch_size = DEFAULT_BATCH_SIZE
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ConfigError(f"batch_size {batch_size} must be at least 1")
        self._max_gen_toks = int(max_gen_toks) if max_gen_toks else min(DEFAULT_MAX_GEN_TOKS, self._max_length // 2)
        if tokenizer is not None and tokenizer.bos_token_id is None and tokenizer.eos_token_id is None:
            raise ConfigError(
                "the tokenizer has neither a BOS nor an EOS token, which lm-eval conditions a text's "
                "first token on; use a tokenizer that defines one"
            )
        self._scores = jax.jit(lambda params, inputs, targets: _token_scores(model, params, inputs, targets))
        self.generator = Generator(model)

    # -- what lm-eval asks of a model -------------------------------------------------------------------------
    @property
    def max_length(self) -> int:
        """The model's context in tokens."""
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        """New tokens a generation task gets when it does not say (``max_gen_toks``)."""
        return self._max_gen_toks

    @property
    def eot_token_id(self) -> int | None:
        return BYTE_EOS if self.hf_tokenizer is None else self.hf_tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token a text's first token is conditioned on: BOS, else EOS (as lm-eval's hf model)."""
        if self.hf_tokenizer is None:
            return BYTE_EOS
        bos = self.hf_tokenizer.bos_token_id
        return bos if bos is not None else self.hf_tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return "bytes" if self.hf_tokenizer is None else self.hf_tokenizer.name_or_path.replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records in ``results["config"]`` about the model."""
        return {
            "model_num_parameters": int(sum(np.size(leaf) for leaf in jax.tree.leaves(self.params))),
            "functrain_run": self.run_dir,
            "functrain_step": self.step,
            "tokenizer": self.tokenizer_name,
        }

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``; special tokens as lm-eval's hf model adds them (none before a text that
        already starts with BOS)."""
        if self.hf_tokenizer is None:
            ids = _Bytes.encode(string)
        else:
            options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            if add_special_tokens is None and has_bos_prefix(string, self.hf_tokenizer.decode(self.prefix_token_id)):
                options["add_special_tokens"] = False
            ids = self.hf_tokenizer.encode(string, **options)
        outside = [i for i in ids if i >= self.vocab_size]
        if outside:
            raise DataError(
                f"token id {outside[0]} of the task's text is outside the model's vocabulary of "
                f"{self.vocab_size} ids; evaluate with the tokenizer the run was trained with "
                f"(--tokenizer PATH, or none for UTF-8 bytes)"
            )
        return list(ids)

    def tok_decode(self, ids: list[int]) -> str:
        if self.hf_tokenizer is None:
            return _Bytes.decode(ids)
        return self.hf_tokenizer.decode(ids, skip_special_tokens=True)

    # -- log-likelihoods ----------------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """``(sum of the continuation's log-probs, whether greedy decoding yields it)`` per request of
        ``(cache key, context ids, continuation ids)``."""
        limit = self.max_length
        collator = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results = []
        for chunk in collator.get_batched(n=self.batch_size):
            windows, spans = [], []
            for _, context, continuation in chunk:
                if not continuation:
                    raise DataError("a loglikelihood request has an empty continuation; check the task's targets")
                if len(continuation) > limit:
                    raise DataError(
                        f"a continuation of {len(continuation)} tokens is longer than the model's "
                        f"context of {limit}; shorten the task's targets"
                    )
                window = (context + continuation)[-(limit + 1) :]  # cut from the left, as lm-eval's hf model
                windows.append(window)
                spans.append((len(window) - 1 - len(continuation), len(window) - 1))
            picked, greedy = self._score_windows(windows)
            for (key, _, _), row_picked, row_greedy, (start, end) in zip(chunk, picked, greedy, spans):
                answer = (float(row_picked[start:end].sum(dtype=np.float64)), bool(row_greedy[start:end].all()))
                results.append(answer)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return collator.get_original(results)

    def _score_windows(self, windows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """One forward over ``windows`` (each predicts its tokens 1.. from 0..-1): per-position scores."""
        length = _bucket(max(len(w) - 1 for w in windows), self.max_length)
        inputs = np.zeros((self.batch_size, length), np.int32)
        targets = np.zeros((self.batch_size, length), np.int32)
        for row, window in enumerate(windows):
            inputs[row, : len(window) - 1] = window[:-1]
            targets[row, : len(window) - 1] = window[1:]
        picked, greedy = self._scores(self.params, inputs, targets)
        return np.asarray(picked)[: len(windows)], np.asarray(greedy)[: len(windows)]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts over lm-eval's disjoint rolling windows of the model's context."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += log_prob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation -----------------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continuations of each request's context, cut at its ``until`` strings and at EOS."""
        args = [request.args for request in requests]
        collator = Collator(
            args, sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]), group_by="gen_kwargs", group_fn=lambda r: r[1]
        )
        results = []
        for group in collator.get_batched(n=0):  # one gen_kwargs group at a time, longest contexts first
            results += self._generate_group([context for context, _ in group], group[0][1])
        return collator.get_original(results)

    def _generate_group(self, contexts: list[str], gen_kwargs: dict[str, Any]) -> list[str]:
        options = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        eos = None if self.eot_token_id is None else self.tok_decode_special(self.eot_token_id)
        until = handle_stop_sequences(options.get("until"), eos=eos)
        new_tokens = int(options["max_gen_toks"])
        room = self.max_length - new_tokens
        if room <= 0:
            raise ConfigError(
                f"the task asks for max_gen_toks={new_tokens} new tokens but the model's context is "
                f"{self.max_length}; lower max_gen_toks in the task's generation_kwargs"
            )
        unused = sorted(set(options) - set(SAMPLING_KEYS))
        if unused:
            log.warning(
                "functrain: warning: the functrain lm-eval model ignores generation_kwargs %s", ", ".join(unused)
            )
        temperature = float(options.get("temperature") or 0.0) if options.get("do_sample") else 0.0
        top_k = options.get("top_k")
        sampling = Sampling(new_tokens, temperature, int(top_k) if top_k else None, seed=0)
        # An empty context is conditioned on the prefix token, as a loglikelihood request's is.
        prompts = [np.array(self.tok_encode(context)[-room:] or [self.prefix_token_id]) for context in contexts]
        texts = []
        for start in range(0, len(prompts), self.batch_size):  # sorted longest first: similar lengths together
            batch = prompts[start : start + self.batch_size]
            for tokens in self.generator.ragged(
                self.params, batch, sampling, rows=self.batch_size, context=self.max_length
            ):
                texts.append(self._continuation_text([int(token) for token in tokens], until))
        return texts

    def tok_decode_special(self, token: int) -> str:
        """The text of one token with special tokens kept (what an ``until`` list holds for EOS)."""
        if self.hf_tokenizer is None:
            return _Bytes.decode([token])
        return self.hf_tokenizer.decode([token], skip_special_tokens=False)

    def _continuation_text(self, tokens: list[int], until: list[str]) -> str:
        if self.eot_token_id is not None and self.eot_token_id in tokens:
            tokens = tokens[: tokens.index(self.eot_token_id)]
        return postprocess_generated_text(self.tok_decode(tokens), stop=until, think_end_token=None)


# -- tasks ------------------------------------------------------------------------------------------------------
def task_manager(tasks: list[str], include_path: str | os.PathLike | None, where: str = "--tasks") -> Any:
    """An lm-eval ``TaskManager`` that knows every name in ``tasks`` (task, group or tag names, or YAML files),
    or a one-line ConfigError naming the first it does not know (``where``: the flag or key that named it).

    The folder ``include_path`` is indexed alone first: lm-eval's own catalogue (thousands of YAMLs, seconds to
    index) is read only when a task is not found there."""
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ConfigError(f"{where} names no task; give at least one lm-eval task name")
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(
            f"the lm-eval include path {str(include_path)!r} is not a directory; pass the folder that "
            f"holds the task YAMLs"
        )
    known = lambda manager, name: name in manager.all_tasks or Path(name).is_file()  # noqa: E731
    if include_path is not None:
        manager = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(known(manager, name) for name in tasks):
            return manager
    manager = _catalogue(None if include_path is None else str(include_path))
    for name in tasks:
        if not known(manager, name):
            close = difflib.get_close_matches(name, manager.all_tasks, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"{where}: lm-eval task {name!r} does not exist; {hint}list them with `lm_eval ls "
                f"tasks`, or pass the folder of its YAML as the include path"
            )
    return manager


@functools.lru_cache(maxsize=4)
def _catalogue(include_path: str | None) -> Any:
    """lm-eval's whole task index (and ``include_path``'s), built once per process: it takes seconds."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def _prepared(manager: Any, tasks: list[str], fewshot_seed: int) -> dict[str, Any]:
    """The loaded tasks, with the defaults ``simple_evaluate`` gives them (zero-shot unless the task says)."""
    loaded = manager.load(list(tasks))
    for task in loaded["tasks"].values():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=fewshot_seed)
    return loaded


def evaluate_tasks(
    lm: FunctrainLM, tasks: list[str], manager: Any, *, limit: float | None = None, log_samples: bool = False
) -> dict[str, Any]:
    """lm-eval's results object for ``tasks`` (``results``, ``configs``, ... and ``samples`` when
    ``log_samples``), exactly as ``lm_eval.simple_evaluate`` returns it."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), task_manager=manager, limit=limit, log_samples=log_samples
    )


def task_scores(lm: FunctrainLM, tasks: list[str], manager: Any, *, limit: float | None = None) -> dict[str, float]:
    """``{"<task>/<metric>": value}`` for ``tasks``, evaluated in this process without touching the global
    random states or the environment report that ``simple_evaluate`` adds (the training loop's evaluation)."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED
    from lm_eval.evaluator import evaluate

    results = evaluate(
        lm=lm,
        task_dict=_prepared(manager, tasks, DEFAULT_OTHER_SEED),
        limit=limit,
        bootstrap_iters=0,
        log_samples=False,
    )
    return flat_scores(results)


def flat_scores(results: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of an lm-eval results object as ``{"<task>/<metric>": value}``: lm-eval's
    ``"acc,none"`` becomes ``acc`` and ``"exact_match,strict-match"`` ``exact_match_strict-match`` (trackers
    such as MLflow take no commas); standard errors are left out."""
    scores = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            name, _, kept_by = key.partition(",")
            if not kept_by or "_stderr" in name or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            scores[f"{task}/{name if kept_by == 'none' else f'{name}_{kept_by}'}"] = float(value)
    return scores
