"""Config files and overrides as plain data: reading a YAML mapping and applying dotted ``key=value`` overrides
(before :func:`functrain.config.load.validate_config` types them), and the inverse for ``fit(config, **overrides)``.
"""

import json
import os
from pathlib import Path
from typing import Any

import yaml

from functrain.core.yaml_text import DuplicateKeyError, load_yaml
from functrain.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form dotted.key=value")
    try:
        parsed = load_yaml(value) if value.strip() else None
    except DuplicateKeyError as exc:
        raise ConfigError(f"override {text!r}: key {exc.key!r} appears twice; keep one") from None
    except yaml.YAMLError:
        parsed = value
    return key.strip().split("."), parsed


def _list_item(node: Any, part: str, text: str) -> bool:
    """Whether ``part`` indexes an item of list ``node`` (``data.sources.0.weight``); any other key of a list is
    a ConfigError."""
    if not isinstance(node, list):
        return False
    if part.isdigit() and int(part) < len(node):
        return True
    raise ConfigError(
        f"override {text!r}: {part!r} is not an item of a list of {len(node)}; index it with a "
        f"number from 0 to {len(node) - 1} (e.g. data.sources.0.weight=2)"
    )


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply dotted ``key=value`` overrides to a nested dict (in a copy); a number after a list key indexes it."""
    merged = json.loads(json.dumps(raw))
    for text in overrides:
        path, value = parse_override(text)
        node = merged
        for part in path[:-1]:
            if _list_item(node, part, text):
                node = node[int(part)]
                continue
            child = node.get(part)
            if not isinstance(child, (dict, list)):
                child = node[part] = {}
            node = child
        if _list_item(node, path[-1], text):
            node[int(path[-1])] = value
        else:
            node[path[-1]] = value
    return merged


def read_yaml(path: str | os.PathLike) -> dict:
    """Read a YAML mapping; a missing file, malformed YAML or a key twice in one mapping is a one-line
    ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a YAML file (see configs/)")
    try:
        raw = load_yaml(path.read_text())
    except DuplicateKeyError as exc:
        raise ConfigError(
            f"config file {str(path)!r} has key {exc.key!r} twice in one mapping, at lines {exc.lines[0]} and "
            f"{exc.lines[1]} (only the last would count); merge them into one"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}: {problem}; fix the file") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, not {type(raw).__name__}")
    return raw


def override_list(overrides: dict[str, Any]) -> list[str]:
    """``{"train.max_steps": 5}`` -> ``["train.max_steps=5"]`` (for ``fit(config, **overrides)``)."""
    return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
