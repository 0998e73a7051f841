"""``functrain plot``: the PNG follows the metrics of one or several runs, marks resumes and skipped steps,
and a run directory without metrics is one line, exit 2, with nothing written."""

import json
from pathlib import Path

import matplotlib.image
import numpy as np

from functrain.commands.cli import main
from functrain.report.events import append_event
from functrain.report.plots import read_run, smooth


def write_metrics(run_dir: Path, losses: list[float | None], nonfinite_at: int | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, loss in enumerate(losses):
        step = 10 * (i + 1)
        lines.append({"step": step, "split": "train", "loss": loss, "grad_norm": 1.0 + i % 3,
                      "learning_rate": 1e-3, "steps_per_sec": 20.0 + i % 2,
                      "nonfinite_steps": int(nonfinite_at is not None and step >= nonfinite_at)})
        if step % 50 == 0:
            lines.append({"step": step, "split": "eval", "loss": (loss or 1.0) * 1.1, "accuracy": 0.5})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run_dir


def pixels(run_dirs: list[Path], out: Path) -> np.ndarray:
    assert main(["plot", *map(str, run_dirs), "-o", str(out)]) == 0
    return matplotlib.image.imread(out)


def test_plot_pixels_follow_the_metrics_of_one_and_several_runs(tmp_path):
    losses = list(np.linspace(4.0, 1.0, 20))
    first = write_metrics(tmp_path / "first", losses)
    one = pixels([first], tmp_path / "one.png")
    write_metrics(first, losses[:10] + [l * 1.5 for l in losses[10:]])
    assert (pixels([first], tmp_path / "one_changed.png") != one).any()

    second = write_metrics(tmp_path / "second", [l * 0.7 for l in losses])
    both = pixels([first, second], tmp_path / "both.png")
    assert (both != pixels([first], tmp_path / "one_again.png")).any()
    write_metrics(second, [l * 0.9 for l in losses])
    assert (pixels([first, second], tmp_path / "both_changed.png") != both).any()


def test_plot_marks_resumes_and_skipped_steps(tmp_path):
    run = write_metrics(tmp_path / "run", list(np.linspace(3.0, 1.0, 12)))
    plain = pixels([run], tmp_path / "plain.png")
    append_event(run, "resume", 60)
    resumed = pixels([run], tmp_path / "resumed.png")
    assert (resumed != plain).any()
    assert read_run(run).resume_steps == [60]

    write_metrics(run, list(np.linspace(3.0, 1.0, 7)) + [None] + list(np.linspace(1.0, 0.9, 4)), nonfinite_at=80)
    assert read_run(run).nonfinite_steps == [80]
    assert (pixels([run], tmp_path / "skipped.png") != resumed).any()


def test_smoothing_is_a_debiased_moving_average_that_passes_over_nan():
    values = np.array([1.0, 1.0, np.nan, 1.0])
    np.testing.assert_allclose(smooth(values), [1.0, 1.0, 1.0, 1.0])
    assert smooth(np.array([0.0, 10.0]))[1] == 10.0 * 0.4 / (1 - 0.6 ** 2)


def test_plot_of_a_run_without_metrics_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(empty)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (empty / "metrics.jsonl").write_text("")
    assert main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 2
    assert "holds no metrics" in capsys.readouterr().err
    assert sorted(p.name for p in empty.iterdir()) == ["metrics.jsonl"] and not (tmp_path / "x.png").exists()


def test_plot_into_a_directory_writes_plot_png_there_and_a_failed_write_is_one_line_leaving_nothing(tmp_path, capsys):
    run = write_metrics(tmp_path / "run", list(np.linspace(3.0, 1.0, 6)))
    into = tmp_path / "figures"
    into.mkdir()
    assert main(["plot", str(run), "-o", str(into)]) == 0
    assert sorted(p.name for p in into.iterdir()) == ["plot.png"]
    assert f"wrote {into / 'plot.png'}" in capsys.readouterr().out
    (tmp_path / "a_file").write_text("not a directory")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["plot", str(run), "-o", str(tmp_path / "a_file" / "x.png")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot write the plot to" in lines[0] and "choose another -o" in lines[0], lines
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
