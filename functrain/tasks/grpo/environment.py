"""Environments: what a multi-turn episode's model talks to (``grpo.environment_factory``), and the checked calls
into them.

``grpo.environment_factory`` names (``module:Class`` or ``path/to/file.py:Class``, TRL's key) a class, or any
callable, that makes an environment: one per completion of a step (made at the first step, reused after). An
environment has

- ``reset(prompt, **columns) -> str | None``: called before an episode with the prompts file's row as keywords
  (TRL's ``reset(**row)``); its text (None or ``""``: none) follows the prompt, as the environment's tokens;
- ``step(completion) -> (text, reward, done)``: the text of the model's turn (without EOS) -> the environment's
  answer (its tokens follow the turn, before the model's next one), a reward (the episode's is the sum of its
  steps') and whether the episode is over.

An environment is called on the host, one at a time, and must be a function of what it is given (no state that
survives ``reset``, no clock, no unseeded randomness): a batch stays a pure function of (weights, data position,
step), and a resumed run draws what an uninterrupted one drew. An environment that raises, or returns something
else than the above, stops the run in one line naming it, the turn and the prompt (a
:class:`~functrain.errors.UserCodeError`: the loop adds the checkpoint the run resumes from).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from functrain.errors import ConfigError, UserCodeError, definition_site, one_line, user_code_site
from functrain.tasks.grpo.rewards import user_object

SETTING = "grpo.environment_factory"


@dataclass(frozen=True)
class EnvironmentFactory:
    """What ``grpo.environment_factory`` names: ``make()`` returns an environment; ``name`` (the factory's
    ``__name__``, as TRL names an environment's reward) names its reward's metrics and its errors."""

    name: str
    make: Callable[[], Any]


def environment_factory(entry: str) -> EnvironmentFactory:
    """The factory of a ``grpo.environment_factory`` entry, checked before anything is written: it imports, is
    callable, and a class defines ``reset`` and ``step``."""
    factory = user_object(entry, SETTING)
    if not callable(factory):
        raise ConfigError(
            f"{SETTING} {entry!r} is a {type(factory).__name__}; name a class (or a function) that makes an environment"
        )
    name = getattr(factory, "__name__", entry)
    if inspect.isclass(factory):
        for method in ("reset", "step"):
            if not callable(getattr(factory, method, None)):
                raise ConfigError(
                    f"{SETTING} {entry!r}: the class {name} has no {method} method; define reset(prompt, **columns) "
                    f"-> str | None and step(completion) -> (text, reward, done)"
                )
    return EnvironmentFactory(name, factory)


def make_environments(factory: EnvironmentFactory, count: int, step: int) -> list[Any]:
    """``count`` environments of ``factory`` (one per completion of this process), made at the step of index
    ``step``."""
    environments = []
    for _ in range(count):
        try:
            environment = factory.make()
        except Exception as exc:  # user code: any failure stops the run in one line
            raise UserCodeError(
                f"the environment factory {factory.name}{_at(exc, factory.make)} raised {one_line(exc)}", step + 1
            ) from exc
        for method in ("reset", "step"):
            if not callable(getattr(environment, method, None)):
                raise UserCodeError(
                    f"the environment factory {factory.name} made a {type(environment).__name__}, "
                    f"which has no {method} method",
                    step + 1,
                )
        environments.append(environment)
    return environments


def reset(environment: Any, name: str, row: dict[str, Any], episode: str, step: int) -> str:
    """The text that opens ``episode`` (``""`` for None): ``environment.reset(**row)``, checked."""
    try:
        text = environment.reset(**row)
    except Exception as exc:  # user code
        raise UserCodeError(
            f"the environment {name}{_at(exc, environment.reset)} raised {one_line(exc)} in reset, "
            f"before the first turn of {episode}",
            step + 1,
        ) from exc
    if text is not None and not isinstance(text, str):
        raise UserCodeError(
            f"the environment {name}{_site(environment.reset)} returned a {type(text).__name__} "
            f"from reset for {episode}, not a string or None",
            step + 1,
        )
    return text or ""


def answer(environment: Any, name: str, completion: str, episode: str, turn: int, step: int) -> tuple[str, float, bool]:
    """``(text, reward, done)`` of ``environment.step(completion)`` at ``turn`` of ``episode``, checked."""
    try:
        returned = environment.step(completion)
    except Exception as exc:  # user code
        raise UserCodeError(
            f"the environment {name}{_at(exc, environment.step)} raised {one_line(exc)} in step at "
            f"turn {turn} of {episode}",
            step + 1,
        ) from exc
    who = f"the environment {name}{_site(environment.step)}"
    where = f"at turn {turn} of {episode}"
    if not isinstance(returned, tuple) or len(returned) != 3:
        raise UserCodeError(
            f"{who} returned a {type(returned).__name__} from step {where}, not (text, reward, done)", step + 1
        )
    text, reward, done = returned
    if not isinstance(text, str):
        raise UserCodeError(
            f"{who} returned a {type(text).__name__} as the text of step {where}, not a string", step + 1
        )
    if not isinstance(reward, (int, float, np.integer, np.floating)) or not math.isfinite(reward):
        raise UserCodeError(f"{who} returned the reward {reward!r} from step {where}, not a finite number", step + 1)
    if not isinstance(done, (bool, np.bool_)):
        raise UserCodeError(f"{who} returned done={done!r} from step {where}, not a bool", step + 1)
    return text, float(reward), bool(done)


def _site(function: Any) -> str:
    """`` (file:line)`` where ``function`` is defined, or nothing."""
    site = definition_site(function)
    return f" ({site})" if site else ""


def _at(error: BaseException, function: Any) -> str:
    """`` (file:line)`` of the user's frame that raised ``error``, else where ``function`` is defined."""
    raised_at = user_code_site(error)
    return f" ({raised_at[1]})" if raised_at else _site(function)
