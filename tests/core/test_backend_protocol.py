"""The loop's contract with the frameworks: both backends implement the written Backend protocol, the loop
reads nothing else, and what the torch twin cannot honour is refused in one line before anything is written."""

import ast
import inspect
from pathlib import Path

import pytest

from functrain import build
from functrain.commands.cli import main
from functrain.core.backend import Backend

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("jax", "torch", "numpy", "optax", "flax", "orbax")
TINY = {"run.dir": "unused", "train.max_steps": 2, "model.hidden": [8], "data.global_batch_size": 8,
        "log.progress": False, "log.trackers": ["jsonl"]}


def _protocol_members() -> list[str]:
    return [name for name in dir(Backend) if not name.startswith("_")] + list(Backend.__annotations__)


@pytest.mark.parametrize("config", ["configs/mlp_digits.yaml", "configs/mlp_digits_torch.yaml"])
def test_each_backend_implements_the_protocol(config, tmp_path):
    run = build(config, **{**TINY, "run.dir": str(tmp_path / "run")})
    assert isinstance(run.backend, Backend)
    for name in _protocol_members():
        assert hasattr(run.backend, name), name
        wanted = getattr(Backend, name, None)
        if callable(wanted):  # the protocol's parameters first; any others optional
            given = inspect.signature(getattr(run.backend, name)).parameters
            expected = list(inspect.signature(wanted).parameters)[1:]
            assert list(given)[:len(expected)] == expected, name
            assert all(given[extra].default is not inspect.Parameter.empty for extra in list(given)[len(expected):])
    assert not (tmp_path / "run").exists()  # building writes nothing


def test_a_missing_method_breaks_the_protocol():
    class Partial:
        name, process_index, process_count, synchronous, writes_checkpoints, devices = "x", 0, 1, True, True, []
    assert not isinstance(Partial(), Backend)


def test_the_loop_imports_no_framework_probes_nothing_and_reads_no_config():
    for module in ("loop", "call_metrics", "evaluation", "announce", "resume"):
        source = (ROOT / "functrain" / "run" / f"{module}.py").read_text()
        tree = ast.parse(source)
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        if module != "call_metrics":  # reading a call's metrics converts numpy values to floats
            assert not imported & set(FRAMEWORKS), (module, imported & set(FRAMEWORKS))
        assert not imported & {"jax", "torch"}, module
        calls = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert "getattr" not in calls, module
        config_reads = [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                        and isinstance(node.value, ast.Attribute) and node.value.attr == "config"]
        assert config_reads == [], (module, config_reads)


@pytest.mark.parametrize("config, overrides, message", [
    ("configs/char_gpt_torch.yaml", ["model.remat=full"],
     "model.remat=full is not implemented by the torch gpt twin (backend: torch); remove model.remat or set "
     "backend=jax"),
    ("configs/char_gpt_torch.yaml", ["model.attention=cudnn"], "model.attention=cudnn is not implemented"),
    ("configs/mlp_digits_torch.yaml", ["optimizer.name=adafactor"],
     "optimizer.name=adafactor is not implemented for backend: torch"),
    ("configs/mlp_digits_torch.yaml", ["mesh.fsdp=2"], "backend: torch shards only over data; set mesh.fsdp=1"),
])
def test_a_twin_mismatch_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, monkeypatch, config, overrides,
                                                               message):
    monkeypatch.chdir(ROOT)
    status = main(["train", config, f"run.dir={tmp_path / 'run'}", "train.max_steps=2", *overrides])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()
