"""An example functrain plugin: the ``tiny_mlp`` model family, registered through the ``functrain.families``
entry point of this package's pyproject.toml."""
