"""Families declare themselves where they live (a ``Family`` in their config module, or a plugin's entry point):
a declaration missing something is refused in one line naming the family and what is missing, the registry
refuses two families of one name or one HF model_type, a broken plugin is one line naming it, and every list
of families the code shows is read off the declarations."""

import importlib
import importlib.metadata
import pkgutil
import sys
from dataclasses import replace
from typing import Literal

import pydantic
import pytest

from functrain.errors import ConfigError
from functrain.models import (
    ENTRY_POINT_GROUP,
    collect_families,
    declared_families,
    families,
    family_named,
    family_names,
)
from functrain.models import configs as config_modules
from functrain.models.configs.base import FamilyConfig
from functrain.models.family import CAPABILITIES, Family
from functrain.models.options import scan_refusal
from functrain.config.load import load_config


class TinyConfig(FamilyConfig):
    name: Literal["tiny"] = "tiny"


COMPLETE = dict(name="tiny", config=TinyConfig, code="tiny_package.model", kind="classifier", scans_layers=False,
                context_parallel=False, pipeline=False, generation_cache=False)


def refusal(**declaration) -> str:
    with pytest.raises(ValueError) as info:
        Family(**declaration)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_declaration_missing_what_is_required_is_refused_in_one_line_naming_the_family_and_what_is_missing():
    assert Family(**COMPLETE).name == "tiny"
    assert refusal(name="tiny", config=TinyConfig, code="tiny_package.model") == (
        "family 'tiny' declares no kind, scans_layers, context_parallel, pipeline, generation_cache; "
        "add them to its Family(...)")
    without_pipeline = {key: value for key, value in COMPLETE.items() if key != "pipeline"}
    assert refusal(**without_pipeline) == "family 'tiny' declares no pipeline; add it to its Family(...)"
    nameless = {key: value for key, value in COMPLETE.items() if key != "name"}
    assert refusal(**nameless) == "the family of TinyConfig declares no name; add it to its Family(...)"


@pytest.mark.parametrize("change, message", [
    (dict(name="tiny model"), "family name 'tiny model' is not an identifier"),
    (dict(config=pydantic.BaseModel), "family 'tiny': config <class 'pydantic.main.BaseModel'> is not a FamilyConfig"),
    (dict(name="small"), "family 'small': its config TinyConfig has name 'tiny'; declare name: Literal['small'] = "),
    (dict(kind="regressor"), "family 'tiny' declares kind 'regressor'; choose one of classifier, causal_lm"),
    (dict(scans_layers="yes"), "family 'tiny' declares scans_layers as something else than True or False"),
    (dict(pipeline=True), "family 'tiny' declares pipeline without scans_layers"),
    (dict(generation_cache=True), "family 'tiny' declares generation_cache but is a classifier"),
    (dict(hf_model_types=("tiny",)), "family 'tiny' declares hf_model_types without hf_mapping"),
    (dict(hf_mapping="pkg.mappings:TINY"), "family 'tiny' declares hf_mapping without hf_model_types"),
    (dict(hf_model_types="tiny", hf_mapping="pkg.mappings:TINY"), "family 'tiny' declares hf_model_types='tiny'"),
    (dict(code="tiny_package:build"), "family 'tiny' declares code='tiny_package:build'; write it as 'package.module'"),
    (dict(torch_twin="pkg.twins"), "family 'tiny' declares torch_twin='pkg.twins'; write it as 'package.module:NAME'"),
])
def test_a_declaration_that_does_not_hold_together_is_refused_in_one_line(change, message):
    assert refusal(**{**COMPLETE, **change}).startswith(message)


def test_every_family_config_class_is_declared_and_every_declaration_sits_beside_its_class():
    declared = dict(declared_families())
    shipped = {family.config for family in declared.values()}
    for info in pkgutil.iter_modules(config_modules.__path__, f"{config_modules.__name__}."):
        for value in vars(importlib.import_module(info.name)).values():
            is_family_config = isinstance(value, type) and issubclass(value, FamilyConfig)
            if is_family_config and isinstance(value.model_fields["name"].default, str):  # selects a family
                assert value in shipped, f"{value.__name__} has a model.name but no module declares its Family"
    assert len(shipped) == len(declared)  # one family a config class
    assert list(families()) == sorted(family.name for family in declared.values())  # no plugin in this env


def entry_point(name: str, value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


def test_a_plugin_adds_its_family_and_a_broken_one_is_one_line_naming_it(tmp_path, monkeypatch):
    (tmp_path / "tiny_plugin.py").write_text(
        "from typing import Literal\n"
        "from functrain.models.configs.base import FamilyConfig\n"
        "from functrain.models.family import Family\n"
        "class TinyConfig(FamilyConfig):\n"
        "    name: Literal['tiny'] = 'tiny'\n"
        "FAMILY = Family(name='tiny', config=TinyConfig, code='tiny_plugin', kind='classifier',\n"
        "                scans_layers=False, context_parallel=False, pipeline=False, generation_cache=False)\n"
        "INCOMPLETE = 'a string'\n")
    (tmp_path / "broken_plugin.py").write_text(
        "from functrain.models.family import Family\n"
        "FAMILY = Family(name='broken', code='broken_plugin')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("tiny_plugin", "broken_plugin"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    registry = collect_families(declared_families(), [entry_point("tiny", "tiny_plugin:FAMILY")])
    assert list(registry) == sorted([*families(), "tiny"]) and registry["tiny"].config.__name__ == "TinyConfig"

    def error(value: str, name: str = "tiny") -> str:
        with pytest.raises(ConfigError) as info:
            collect_families([], [entry_point(name, value)])
        assert "\n" not in str(info.value)
        return str(info.value)

    assert error("broken_plugin:FAMILY", "broken") == (
        "family plugin 'broken' (broken_plugin:FAMILY) does not load (ValueError: family 'broken' declares no config, "
        "kind, scans_layers, context_parallel, pipeline, generation_cache; add them to its Family(...)); fix or "
        "uninstall the package that provides it")
    assert error("no_such_plugin_package:FAMILY") == (
        "family plugin 'tiny' (no_such_plugin_package:FAMILY) does not load (ModuleNotFoundError: No module named "
        "'no_such_plugin_package'); fix or uninstall the package that provides it")
    assert error("tiny_plugin:INCOMPLETE") == (
        "family plugin 'tiny' (tiny_plugin:INCOMPLETE) is a str, not a functrain Family; point the entry point at "
        "one (package.module:FAMILY)")


def test_two_families_of_one_name_or_one_hf_model_type_are_refused():
    llama = family_named("llama")
    again = entry_point("llama", "functrain.models.configs.llama:FAMILY")
    with pytest.raises(ConfigError, match=r"^family plugin 'llama' \(functrain.models.configs.llama:FAMILY\) declares "
                                          r"family 'llama', as functrain.models.configs.llama does; rename one"):
        collect_families(declared_families(), [again])
    with pytest.raises(ConfigError, match=r"^second converts HF model_type 'llama', as family 'llama' does; keep one"):
        mistral = replace(family_named("mistral"), hf_model_types=("mistral", "llama"))
        collect_families([("first", llama), ("second", mistral)])


def test_the_lists_of_families_are_read_off_the_declarations():
    for capability in CAPABILITIES:
        assert family_names(capability) == [name for name, family in families().items() if family.can(capability)]
    assert family_names("torch_twin") == ["gpt", "mlp"]  # what backend: torch trains (torch_bridge/twins.py)
    assert family_names("hf_conversion") == sorted(set(family_names()) - {"gpt", "mlp"})
    assert set(family_names("expert_parallel")) == {"deepseek_v3", "gemma4", "glm4_moe", "gpt_oss", "llama4", "mixtral",
                                                "qwen2_moe", "qwen3_moe", "qwen3_5_moe_text", "qwen3_next"}
    hybrids = {"qwen3_5_moe_text", "qwen3_5_text", "qwen3_next"}  # Gated DeltaNet's state spans the whole sequence
    # Llama 4's chunks are segments of the sequence in its order, not the context split's.
    assert set(family_names()) - set(family_names("context_parallel")) == {"gemma2", "gemma3_text", "gemma4", "gpt2",
                                                                           "mlp", "llama4", *hybrids}
    # Gemma 4's per-layer inputs ride beside the scan, which pipeline stages do not split.
    assert set(family_names("scans_layers")) - set(family_names("pipeline")) == {"gemma4", "llama4", *hybrids}
    assert family_names("generation_cache") == family_names("language_model") == sorted(set(family_names()) - {"mlp"})
    for name in family_names("hf_conversion"):  # the code writes the model_type its family declares first
        family = family_named(name)
        assert family.module().to_hf_config(family.config())["model_type"] == family.hf_model_types[0]
    with pytest.raises(ValueError, match="unknown family capability 'flies'; choose one of language_model, "):
        family_names("flies")
    scanning = ", ".join(family_names("scans_layers"))
    assert scan_refusal("mlp") == (f"model.scan_layers is not supported by model mlp (only by {scanning}); "
                                   f"remove model.scan_layers or set it to false")
    data = {"name": "synthetic", "seq_len": 8}
    with pytest.raises(ConfigError) as info:
        load_config(None, [], base={"model": {"name": "gemma2"}, "data": data, "mesh": {"context": 2}})
    assert f"({', '.join(family_names('context_parallel'))}) and gemma2 has none" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(None, [], base={"model": {"name": "llama"}, "data": data, "mesh": {"expert": 2}})
    moe = ", ".join(family_names("expert_parallel"))
    assert f"mixture-of-experts models ({moe}) and model llama has no experts" in str(info.value)


@pytest.fixture
def registry(monkeypatch):
    """Swap families in the registry for a test: ``registry(family, ...)`` replaces those of the same names."""
    import functrain.models

    shipped = functrain.models.declared_families()

    def swap(*changed: Family) -> None:
        by_name = {family.name: family for family in changed}
        monkeypatch.setattr(functrain.models, "declared_families",
                            lambda: [(where, by_name.get(family.name, family)) for where, family in shipped])
        families.cache_clear()

    yield swap
    families.cache_clear()


def test_a_family_that_scans_but_does_not_pipeline_is_refused_stages(registry):
    overrides = ["model.n_layers=4", "model.scan_layers=true", "mesh.pipeline=2"]
    assert load_config("configs/char_gpt.yaml", overrides).mesh.pipeline == 2
    registry(replace(family_named("gpt"), pipeline=False))
    with pytest.raises(ConfigError) as info:
        load_config("configs/char_gpt.yaml", overrides)
    pipelining = ", ".join(family_names("pipeline"))
    assert "gpt" not in pipelining.split(", ") and str(info.value) == (
        "invalid config: mesh.pipeline=2 x mesh.dcn_pipeline=1 (2 stages) splits a model's scanned layers and model "
        f"gpt does not pipeline them (only {pipelining} do); set mesh.pipeline=1")
