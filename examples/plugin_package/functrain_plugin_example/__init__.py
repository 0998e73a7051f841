"""An example functrain plugin: the ``tiny_mlp`` model family and the ``smoothed_classify`` task, registered through
the ``functrain.families`` and ``functrain.tasks`` entry points of this package's pyproject.toml."""
