"""The config's ``model`` section: a union discriminated by ``model.name``, the registered family's own config
class (:func:`functrain.models.families`), or a factory (``model.target``) whose keyword arguments are the
section's other keys, or the record of a model object given to ``fit``."""

from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import pydantic
from pydantic import ConfigDict

from functrain.config.sections import PYTHON_OBJECT, check_target
from functrain.core.section import Section
from functrain.models import families, family_names
from functrain.models.configs.base import FamilyConfig, ModelConfig


class TargetModelConfig(ModelConfig):
    """``model.target: "pkg.module:factory"``: the factory is called with the section's other keys (except
    ``kind``, the built-in loss when the data's fields do not say: ``classifier`` or ``causal_lm``) and
    returns the model (linen, NNX, ``FunctionalModel`` or, with ``backend: torch``, an ``nn.Module``).

    The keys are the factory's own: functrain reads only ``vocab_size`` and ``num_classes`` among them (an
    integer given there bounds the token ids or labels the data may hold, and ``data.name: synthetic`` draws
    ids below ``vocab_size``); the model's context, decoder shape (MFU) and layers are its own business."""

    model_config = ConfigDict(extra="allow")
    target: Annotated[str, pydantic.AfterValidator(check_target)]
    kind: Literal["classifier", "causal_lm"] | None = None

    def factory_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for the factory."""
        return dict(self.model_extra or {})

    def _integer_keyword(self, key: str) -> int | None:
        value = self.factory_kwargs().get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def vocabulary_size(self) -> int | None:
        """The factory's ``vocab_size`` keyword, when it is given as an integer."""
        return self._integer_keyword("vocab_size")

    def class_count(self) -> int | None:
        """The factory's ``num_classes`` keyword, when it is given as an integer."""
        return self._integer_keyword("num_classes")


class PythonModelConfig(Section, ModelConfig):
    """Recorded in place of a model section when ``fit`` is given a model object: its type, for the record
    (every question about the model is answered None: functrain knows nothing of it)."""

    python_object: str  # the name is PYTHON_OBJECT


# The tags of the model section's union besides the registered names.
TARGET_TAG = "target"


def model_section_tag(value: Any) -> str | None:
    """Which member of the ``model`` union ``value`` (a dict from YAML, or a validated section) belongs to:
    the family's ``name``, ``target`` or ``python_object``; None when it names none."""
    if isinstance(value, TargetModelConfig):
        return TARGET_TAG
    if isinstance(value, PythonModelConfig):
        return PYTHON_OBJECT
    if isinstance(value, ModelConfig):
        return value.registry_name()
    if isinstance(value, dict):
        if TARGET_TAG in value:
            return TARGET_TAG
        if set(value) == {PYTHON_OBJECT}:
            return PYTHON_OBJECT
        name = value.get("name")
        return name if isinstance(name, str) else None
    return None


# A member per registered family, tagged with its name, beside a factory's section and a Python object's.
_TAGGED_SECTIONS = (
    *(Annotated[family.config, pydantic.Tag(name)] for name, family in families().items()),
    Annotated[TargetModelConfig, pydantic.Tag(TARGET_TAG)],
    Annotated[PythonModelConfig, pydantic.Tag(PYTHON_OBJECT)],
)
if TYPE_CHECKING:  # the union is made from the registry at run time; to mypy it is the kinds of its members
    ModelSection = FamilyConfig | TargetModelConfig | PythonModelConfig
else:
    # Members known at run time only: X | Y cannot spell them (hence the noqa).
    ModelSection = Annotated[Union[_TAGGED_SECTIONS], pydantic.Discriminator(model_section_tag)]  # noqa: UP007
MODEL_TAGS = frozenset({*families(), TARGET_TAG, PYTHON_OBJECT})


def dense_moe_refusal(key: str, model_name: Any, fix: str | None = None) -> str:
    """The refusal of a mixture-of-experts option on a model without experts (``fix``: default, remove it)."""
    return (
        f"{key} applies to mixture-of-experts models ({', '.join(family_names('expert_parallel'))}) and model "
        f"{model_name} has no experts; {fix or f'remove {key}'}"
    )
