"""The config classes of the model families: pydantic only, no JAX, so the run config's ``model`` section
(a union of them, :mod:`functrain.config.schema`) validates without importing any model code.

:mod:`functrain.models.configs.base` holds what every model config answers (context, vocabulary, decoder shape,
scanned layers); each family's module holds its class and ends with its declaration, ``FAMILY =
Family(...)`` (:mod:`functrain.models.family`), which the registry (:mod:`functrain.models`) collects.
"""
