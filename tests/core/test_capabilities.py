"""Backends by what they can do: every backend a config may name is declared with its capabilities, and a setting
that needs a capability the run's backend lacks is refused in one line naming a backend that has it."""

import importlib
import typing

import pytest

import functrain
from functrain.config.load import load_config
from functrain.config.schema import RunSections
from functrain.core.capabilities import BACKENDS, BackendCapabilities, backends_with, capabilities_of
from functrain.errors import ConfigError
from functrain.run.jax_backend import JaxBackend
from functrain.tasks import declarations
from functrain.tasks.base import Task

CONFIG = "configs/char_gpt.yaml"
# Settings refused (or not) when the config is validated, by the capability they need.
VALIDATED = {
    "context_parallel": ["mesh.context=2"],
    "pipeline": ["mesh.pipeline=2", "model.scan_layers=true"],
    "param_dtype": ["train.param_dtype=bfloat16"],
    "offload_optimizer": ["train.offload_optimizer=true"],
    "fp8": ["train.fp8=true"],
    "torch_compile": ["train.torch_compile=true"],
    "local_checkpoints": ["checkpoint.local_dir=/dev/shm/functrain-local", "checkpoint.local_every_steps=10"],
}
# Settings the builder refuses (before anything is written), by the capability they need.
BUILT = {
    "compiles_with_xla": {"profile.steps": 1},
    "starts_from_weights": {"train.init_from": "{tmp}/trained"},
    "decodes_in_loop": {"eval.samples.count": 1},
}
TINY = {"train.max_steps": 2, "log.progress": False, "log.trackers": ["jsonl"], "eval.samples.count": 0}


def _names_one_that_has(message: str, capability: str) -> bool:
    return any(f"backend={able}" in message or f"backend: {able}" in message for able in backends_with(capability))


def test_the_config_names_the_declared_backends_and_each_backend_its_own():
    from torch_bridge.backend import TorchBackend

    assert typing.get_args(RunSections.model_fields["backend"].annotation) == tuple(BACKENDS)
    assert [capabilities.name for capabilities in BACKENDS.values()] == list(BACKENDS)
    assert {JaxBackend.name, TorchBackend.name} == set(BACKENDS)
    assert all(isinstance(capabilities, BackendCapabilities) for capabilities in BACKENDS.values())


def test_the_capabilities_asked_are_declared():
    asked = [*VALIDATED, *BUILT, "runs_programs", "reads_user_model_shape"]
    assert sorted(asked) == sorted(field for field in BackendCapabilities.__dataclass_fields__ if field != "name")


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("capability", list(VALIDATED))
def test_a_validated_setting_is_refused_by_a_backend_without_its_capability_only(backend, capability):
    overrides = [f"backend={backend}", *VALIDATED[capability]]
    if getattr(capabilities_of(backend), capability):
        try:
            load_config(CONFIG, overrides)
        except ConfigError as error:  # another limit (the model's, the mesh's) may refuse it, never the backend
            assert "backend" not in str(error), str(error)
        return
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, overrides)
    message = str(info.value)
    assert "\n" not in message and _names_one_that_has(message, capability), message


@pytest.mark.parametrize("backend, capability", [
    (backend, capability) for backend in BACKENDS for capability in BUILT
    if not getattr(capabilities_of(backend), capability)
])
def test_a_built_setting_is_refused_by_a_backend_without_its_capability(tmp_path, backend, capability):
    (tmp_path / "trained" / "checkpoints").mkdir(parents=True)
    setting = {key: value.format(tmp=tmp_path) if isinstance(value, str) else value
               for key, value in BUILT[capability].items()}
    with pytest.raises(ConfigError) as info:
        functrain.build(CONFIG, **{**TINY, "run.dir": str(tmp_path / "run"), "backend": backend, **setting})
    message = str(info.value)
    assert "\n" not in message and _names_one_that_has(message, capability), message
    assert not (tmp_path / "run").exists()


def test_a_task_trains_on_the_backends_that_run_programs_unless_both_twins_build_its_loss():
    tasks = {name: importlib.import_module(entry.module).TASKS[name] for name, entry in declarations().items()}
    assert Task.backends == backends_with("runs_programs") != tuple(BACKENDS)
    everywhere = {name for name, task in tasks.items() if task.backends == tuple(BACKENDS)}
    assert everywhere == {"classify", "causal_lm"}  # the supervised task: its loss is built by both twins
    assert all(task.backends == Task.backends for name, task in tasks.items() if name not in everywhere)
