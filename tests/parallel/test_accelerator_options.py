"""Options for accelerators asked for where they cannot run (here, a CPU): one line naming the key and the
fix, exit 2 from the CLI, and no run directory created."""

import pytest

from functrain.commands import cli


@pytest.mark.parametrize("override,expected", [
    ("model.attention=cudnn", "model.attention=cudnn needs an NVIDIA GPU"),
    ("model.attention=splash", "model.attention=splash needs a TPU and this run's devices are cpu; set "
                               "model.attention=auto or model.attention=xla"),
    ("model.remat=sometimes", "model.remat"),
    ("model.remat=offload", "model.remat=offload needs a GPU or TPU with a pinned_host memory space"),
    ("train.offload_optimizer=true", "train.offload_optimizer needs a GPU or TPU with a pinned_host memory space"),
])
def test_options_that_cannot_run_here_are_one_line_exit_2(tmp_path, capsys, override, expected):
    run_dir = tmp_path / "run"
    assert cli.main(["train", "configs/char_gpt.yaml", f"run.dir={run_dir}", "train.max_steps=2", override]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("functrain: error:") and expected in lines[0], lines
    assert not run_dir.exists()
