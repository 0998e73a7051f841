"""A third-party family and task, installed as a package: examples/plugin_package registers ``tiny_mlp`` through the
``functrain.families`` entry point and ``smoothed_classify`` through ``functrain.tasks``, and ``functrain train``
trains configs naming them."""

import json
import shutil
import subprocess
import sys

from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "examples" / "plugin_package"


def test_an_installed_plugin_family_and_task_are_registered_and_train(tmp_path, python_runner):
    source, site, run_dir, task_dir = tmp_path / "source", tmp_path / "site", tmp_path / "run", tmp_path / "task"
    shutil.copytree(PACKAGE, source)  # pip builds in the source tree: keep examples/ clean
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(source)], check=True, capture_output=True, timeout=300)
    proc = python_runner(f"""
        from functrain.commands.cli import main
        from functrain.models import family_names
        from functrain.config.load import load_config
        print("families:", family_names())
        try:
            load_config(None, [], base={{"model": {{"name": "tiny_mpl"}}, "data": {{"name": "digits"}}}})
        except Exception as exc:
            print("error:", exc)
        status = main(["train", {str(PACKAGE / "tiny_mlp_digits.yaml")!r}, "run.dir={run_dir}", "train.max_steps=6",
                       "log.every_steps=2", "data.eval_fraction=0", "checkpoint.every_steps=0", "log.tensorboard=false",
                       "log.progress=false"])
        print("status:", status)
        from functrain.tasks import task_names, task_panels
        print("tasks:", task_names(), [panel.title for panel in task_panels()])
        status = main(["train", {str(PACKAGE / "tiny_mlp_digits.yaml")!r}, "run.dir={task_dir}", "train.max_steps=4",
                       "task=smoothed_classify", "smoothed_classify.smoothing=0.2", "log.every_steps=2",
                       "data.eval_fraction=0", "checkpoint.every_steps=0", "log.tensorboard=false",
                       "log.progress=false"])
        print("task status:", status)
    """, env={"PYTHONPATH": str(site)})
    lines = proc.stdout.splitlines()
    assert "tiny_mlp" in next(line for line in lines if line.startswith("families:"))
    assert next(line for line in lines if line.startswith("error:")).startswith(
        "error: config key 'model': unknown model.name 'tiny_mpl'; choose one of deepseek_v3, ")
    assert "tiny_mlp" in next(line for line in lines if line.startswith("error:"))
    assert "status: 0" in lines
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [2, 4, 6]
    assert all(r["loss"] > 0 and 0 <= r["accuracy"] <= 1 for r in records if r["split"] == "train")
    assert "name: tiny_mlp" in (run_dir / "config.yaml").read_text()
    # The task: declared by the plugin (with its plot panel), trained with its section's setting.
    tasks = next(line for line in lines if line.startswith("tasks:"))
    assert "'smoothed_classify'" in tasks and "'hard-label loss'" in tasks
    assert "task status: 0" in lines
    records = [json.loads(line) for line in (task_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [2, 4]
    assert all(r["loss"] > 0 and r["hard_loss"] > 0 for r in records if r["split"] == "train")
    assert "smoothing: 0.2" in (task_dir / "config.yaml").read_text()
