"""Reward functions: named in ``grpo.reward_funcs``, called on the host with TRL's signature, checked.

A reward function is ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``: ``prompts`` and
``completions`` as TRL passes them (strings, or message lists for conversational prompts), ``completion_ids`` the
completions' token ids (lists of ints, EOS included), and every other column of the prompts file by name, one
value per completion (with an environment, also ``environments``: the completions' environments, TRL's keyword,
and a completion is the whole episode's text). ``None`` marks a completion the function does not score (it is left
out of that function's mean; a completion no function scores gets advantage 0, as in TRL).

``grpo.reward_funcs`` entries are ``module:function`` import paths, ``path/to/file.py:function`` (a file, relative to
the working directory, loaded as a module), or the built-ins: ``accuracy`` (1 when the
completion's final answer equals the row's ``answer`` column: the text of its last ``<answer>...</answer>``, else
its last number, compared as numbers when both are numbers, else as stripped text) and ``format`` (1 when the whole
completion matches ``grpo.format_pattern``, a regex matched with ``re.DOTALL``).

A function that raises, returns the wrong number of rewards, or a NaN or a value that is not a number stops the
run with one line naming it with its file and line (a :class:`~functrain.errors.UserCodeError`: the loop adds the
checkpoint the run resumes from once the function is fixed).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from functrain.core.targets import import_target
from functrain.errors import ConfigError, UserCodeError, definition_site, one_line, user_code_site
from functrain.tasks.grpo.config import BUILTIN_REWARDS

# The keyword that hands a reward function the episodes' environments (TRL's name), one per completion.
ENVIRONMENTS = "environments"
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class RewardFunction:
    """A reward function and the name its metrics carry (``rewards/<name>/mean``: the function's ``__name__``,
    as TRL names them)."""

    name: str
    function: Callable[..., Any]


def _text(completion: Any) -> str:
    """A completion's text (a conversational completion's last message's content)."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def final_answer(text: str) -> str | None:
    """The answer a completion gives: its last ``<answer>...</answer>``, else its last number, else None."""
    tagged = ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _same_answer(given: str | None, expected: Any) -> bool:
    if given is None or expected is None:
        return False
    try:
        return math.isclose(float(given), float(expected), rel_tol=0.0, abs_tol=1e-9)
    except ValueError:
        return given.strip() == str(expected).strip()


def accuracy(completions: list[Any], answer: list[Any], **columns: Any) -> list[float]:
    """1.0 where the completion's final answer (:func:`final_answer`) equals the row's ``answer``, else 0.0."""
    return [float(_same_answer(final_answer(_text(c)), expected)) for c, expected in zip(completions, answer)]


def format_reward(pattern: str) -> Callable[..., list[float]]:
    """The built-in ``format`` reward: 1.0 where the whole completion matches ``pattern``, else 0.0."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ConfigError(f"grpo.format_pattern {pattern!r} is not a regex ({exc}); fix it") from None

    def format(completions: list[Any], **columns: Any) -> list[float]:
        return [float(compiled.fullmatch(_text(c)) is not None) for c in completions]

    return format


def reward_functions(
    names: list[str], format_pattern: str, columns: set[str], environment: bool = False
) -> list[RewardFunction]:
    """The functions ``grpo.reward_funcs`` names, each checked against the keywords it will be called with
    (``prompts``, ``completions``, ``completion_ids``, the prompts file's ``columns``, and ``environments`` with an
    ``environment``, which then scores the episodes too: no function is needed)."""
    if not names and not environment:
        raise ConfigError(
            f"task grpo needs at least one reward function; set grpo.reward_funcs to module:function names or "
            f"the built-ins {', '.join(BUILTIN_REWARDS)}, or grpo.environment_factory to an environment"
        )
    if environment:
        columns = columns | {ENVIRONMENTS}
    functions = []
    for name in names:
        if name == "accuracy":
            if "answer" not in columns:
                raise ConfigError(
                    "the accuracy reward compares each completion with its row's answer column and the prompts "
                    'file has none; add "answer" to every line or remove accuracy from grpo.reward_funcs'
                )
            function = accuracy
        elif name == "format":
            function = format_reward(format_pattern)
        elif ":" in name:
            function = user_object(name, "grpo.reward_funcs entry")
        else:
            raise ConfigError(
                f"grpo.reward_funcs entry {name!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor a "
                f"module:function or file.py:function path; fix it"
            )
        _check_signature(name, function, columns)
        functions.append(RewardFunction(getattr(function, "__name__", name), function))
    return functions


def user_object(entry: str, setting: str) -> Any:
    """The object a ``module:attribute`` or ``path/to/file.py:attribute`` entry of ``setting`` names; one that does
    not import is a one-line ConfigError naming the entry."""
    return _from_file(entry, setting) if ".py:" in entry else import_target(entry, setting)


def _from_file(name: str, setting: str) -> Any:
    """The object of a ``path/to/file.py:attribute`` entry (the file run as a module of its own name)."""
    path, _, attribute = name.rpartition(":")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{setting} {name!r}: {path} is not a file; fix the path")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    assert spec is not None and spec.loader is not None, "a .py file has a source loader"
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 (user code: any failure is one line)
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ConfigError(f"{setting} {name!r}: {path} does not run ({detail}); fix it") from None
    if not hasattr(module, attribute):
        raise ConfigError(f"{setting} {name!r}: {path} has no {attribute!r}; fix the name")
    return getattr(module, attribute)


def _check_signature(name: str, function: Any, columns: set[str]) -> None:
    if not callable(function):
        raise ConfigError(f"grpo.reward_funcs entry {name!r} is a {type(function).__name__}, not a function")
    keywords: dict[str, list[Any]] = {name: [] for name in ("prompts", "completions", "completion_ids", *columns)}
    try:
        inspect.signature(function).bind(**keywords)
    except TypeError as exc:
        raise ConfigError(
            f"the reward function {name!r} cannot be called as f(prompts, completions, completion_ids, "
            f"**columns) ({exc}); take those keywords (and **kwargs for the columns you do not read)"
        ) from None
    except ValueError:  # no signature to read (a builtin): it is tried on the first batch
        return


def scores(
    functions: list[RewardFunction],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
    step: int,
) -> np.ndarray:
    """Each function's rewards ``[B, F]`` float32 (NaN where it returned None) for the step of index ``step`` (step
    ``step + 1`` of metrics.jsonl); a function that raises or returns something else than one number or None per
    completion is a one-line :class:`~functrain.errors.UserCodeError` naming it, its file and line."""
    count = len(completions)
    table = np.full((count, len(functions)), np.nan, np.float32)
    for column, reward in enumerate(functions):
        try:
            values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as exc:  # user code: any failure stops the run in one line
            raised_at = user_code_site(exc)
            site = raised_at[1] if raised_at else definition_site(reward.function)
            where = f" ({site})" if site else ""
            raise UserCodeError(f"the reward function {reward.name}{where} raised {one_line(exc)}", step + 1) from exc
        site = definition_site(reward.function)
        who = f"the reward function {reward.name}" + (f" ({site})" if site else "")
        try:
            values = list(values)
        except TypeError:
            raise UserCodeError(f"{who} returned a {type(values).__name__}, not a list of rewards", step + 1) from None
        if len(values) != count:
            raise UserCodeError(f"{who} returned {len(values)} rewards for {count} completions", step + 1)
        for row, value in enumerate(values):
            if value is None:
                continue
            if not isinstance(value, (int, float, np.integer, np.floating)) or not math.isfinite(value):
                raise UserCodeError(
                    f"{who} returned {value!r} for completion {row}: not a finite number or None", step + 1
                )
            table[row, column] = value
    return table
