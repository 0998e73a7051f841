"""YAML read strictly: a key twice in one mapping is an error naming the key and both lines.

PyYAML keeps the last of two equal keys without a word, so a config with ``train:`` twice silently drops the
first section. :func:`load_yaml` reads with a loader that refuses that (YAML 1.2 requires unique keys too); merge
keys (``<<: *base``) still override what they merge, as YAML means them to.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError

MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(ConstructorError):
    """A mapping holds one key twice (``.key``, ``.lines``: where each occurrence starts, from 1)."""

    def __init__(self, key: Any, lines: tuple[int, int], mark: Any) -> None:
        self.key, self.lines = key, lines
        super().__init__(
            problem=f"key {key!r} appears twice in one mapping, at lines {lines[0]} and {lines[1]} (only the last "
            f"would count)",
            problem_mark=mark,
        )


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise DuplicateKeyError(key, (first_line[key], line), key_node.start_mark)
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that raises :class:`DuplicateKeyError` (a ``yaml.YAMLError``) for a repeated key."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data, no Python objects
