"""Errors for bad input: each carries one line that names the problem and the fix.

The CLI prints that line and exits with status 2 (no traceback unless ``--debug``).
The exit statuses of ``functrain train`` live here too (see :mod:`functrain.callbacks.outcome` for what each means):
the launcher of a multi-process job needs them, below everything that runs a job.
"""

EXIT_FINISHED = 0
EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_MOSTLY_SKIPPED = 4
EXIT_SIGNAL = 75
# Statuses with which a process of a multi-process job ends on purpose (every process agrees on them):
# the launcher does not take them for a crash that should stop the other processes.
PLANNED_EXITS = (EXIT_FINISHED, EXIT_NONFINITE, EXIT_MOSTLY_SKIPPED, EXIT_SIGNAL)


# How to install PyTorch, in the errors that need it: the script picks the CPU build where no GPU is present (a plain
# `pip install torch` pulls several GB of CUDA packages onto a machine that cannot use them).
TORCH_INSTALL = (
    "install it with `sh tools/install_torch.sh PYTHON` from a checkout (the CPU build where no GPU is present), "
    "or pip install 'functrain[torch]'"
)


class FunctrainError(Exception):
    """Bad input from the user: a config, data, checkpoint or directory problem."""


class ConfigError(FunctrainError):
    """A config file or override is malformed, unknown or of the wrong type."""


class DataError(FunctrainError):
    """A data source is missing, empty or does not fit the requested batching."""


class CheckpointError(FunctrainError):
    """A checkpoint is missing, damaged or incompatible with the current run."""
