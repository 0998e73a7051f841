"""The ``functrain`` command line: one module per verb, dispatched by :mod:`functrain.commands.cli`."""
