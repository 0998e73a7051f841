"""Loading a config: a YAML file (or a dict) with dotted command-line overrides, validated into a
:class:`~functrain.config.schema.Config`; the first problem is one :class:`~functrain.errors.ConfigError` line that
names the key (and, for a misspelt key, the nearest valid one)."""

import difflib
import os
import types
import typing
from typing import Any, Union

import pydantic
from pydantic import BaseModel

from functrain.config.files import apply_overrides, read_yaml
from functrain.config.model_section import MODEL_TAGS, dense_moe_refusal
from functrain.config.schema import Config, config_class
from functrain.errors import ConfigError
from functrain.models import families, model_config_class
from functrain.models.configs.moe import MOE_RUNTIME_KEYS


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The section class a field holds, alone or optional (``model.lora``, ``model.rope_scaling``); None for
    other fields."""
    union = typing.get_origin(annotation) in (Union, types.UnionType)
    members = [
        member for member in (typing.get_args(annotation) if union else (annotation,)) if member is not type(None)
    ]
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel):
        return members[0]
    return None


def _all_keys(schema: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key a schema accepts (for 'did you mean' suggestions)."""
    keys = []
    for name, field in schema.model_fields.items():
        keys.append(prefix + name)
        section = _section_class(field.annotation)
        if section is not None:
            keys.extend(_all_keys(section, prefix + name + "."))
    return keys


def _suggest(key: str, model_name: str | None) -> str:
    valid = _all_keys(config_class())
    if isinstance(model_name, str) and model_name in families():
        valid += _all_keys(model_config_class(model_name), "model.")
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def _format_validation_error(error: pydantic.ValidationError, raw: dict) -> str:
    """One line for the first problem: the dotted key, what is wrong and the nearest valid key."""
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"] if not str(part).startswith("function-")]
    if loc[:1] == ["model"] and len(loc) > 1 and loc[1] in MODEL_TAGS:
        del loc[1]  # the union's member (model.name), which pydantic puts in the path
    key = ".".join(loc)
    model_name = raw.get("model", {}).get("name") if isinstance(raw.get("model"), dict) else None
    if first["type"] == "extra_forbidden":
        if loc[:1] == ["model"] and loc[-1] in MOE_RUNTIME_KEYS:
            return dense_moe_refusal(key, model_name)
        return f"unknown config key '{key}'{_suggest(key, model_name)}"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] in ("value_error", "assertion_error") and (not key or message.startswith(f"{key}.")):
        return f"invalid config: {message}"
    given = first.get("input")
    given_text = "" if isinstance(given, (dict, BaseModel)) else f" (got {given!r})"
    return f"config key '{key or 'model'}': {message}{given_text}"


def validate_config(raw: dict) -> Config:
    """Validate a nested dict into a :class:`Config`, or raise a one-line ConfigError."""
    try:
        return config_class().model_validate(raw)
    except pydantic.ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, raw)) from None
    except ValueError as exc:  # the model registry's unknown-name error
        raise ConfigError(str(exc)) from None


def load_config(
    path: str | os.PathLike | None = None, overrides: list[str] | None = None, base: dict | None = None
) -> Config:
    """Load ``path`` (or start from ``base``), apply ``overrides`` and validate."""
    raw = read_yaml(path) if path is not None else dict(base or {})
    return validate_config(apply_overrides(raw, list(overrides or [])))
