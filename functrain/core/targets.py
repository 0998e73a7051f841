"""Objects named in a config by import path (``"package.module:attribute"``): models, data, optimizers,
transforms, reward functions."""

import importlib
from typing import Any

from functrain.errors import ConfigError


def import_target(path: str, what: str) -> Any:
    """The object at ``"package.module:attribute"``; a path that does not resolve is a ConfigError naming it."""
    module_name, _, attribute = path.partition(":")
    fix = "fix the import path (package.module:attribute, importable from the working directory or PYTHONPATH)"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what}={path!r} does not resolve: cannot import {module_name!r} ({exc}); {fix}") from None
    obj = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{what}={path!r} does not resolve: {module_name!r} has no attribute {attribute!r}; {fix}"
            )
        obj = getattr(obj, part)
    return obj
