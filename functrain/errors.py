"""Errors for bad input: each carries one line that names the problem and the fix.

The CLI prints that line and exits with status 2 (no traceback unless ``--debug``).
"""


class FunctrainError(Exception):
    """Bad input from the user: a config, data, checkpoint or directory problem."""


class ConfigError(FunctrainError):
    """A config file or override is malformed, unknown or of the wrong type."""


class DataError(FunctrainError):
    """A data source is missing, empty or does not fit the requested batching."""


class CheckpointError(FunctrainError):
    """A checkpoint is missing, damaged or incompatible with the current run."""
