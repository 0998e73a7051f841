"""The typed run config: its sections, the whole config's cross-checks, loading a YAML file with dotted overrides
into it, and one-line errors that name the key. It reads no data and builds nothing: :mod:`functrain.run` does."""
