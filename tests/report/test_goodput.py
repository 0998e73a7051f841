"""Goodput from events.jsonl: the arithmetic on made-up events, and the events a real run writes."""

import json

from functrain.commands import cli
from functrain.callbacks.time_spent import TimeSpent
from functrain.report.goodput import goodput_of, goodput_lines
from functrain.report.metrics import TAIL_BYTES, last_logged_step


def _events() -> list[dict]:
    """A run started at t=0, killed after step 30 (last event t=40), restarted at t=50 from a local step 20."""
    return [
        {"event": "start", "step": 0, "time": 10.0, "session_started": 0.0,
         "seconds": {"startup": 6.0, "compile": 4.0, "restore": 0.0}},
        {"event": "progress", "step": 20, "time": 30.0,
         "seconds": {"startup": 6.0, "compile": 4.0, "restore": 0.0, "save": 2.0}},
        {"event": "progress", "step": 30, "time": 40.0,
         "seconds": {"startup": 6.0, "compile": 4.0, "restore": 0.0, "save": 2.0, "eval": 4.0}},
        {"event": "resume", "step": 20, "time": 55.0, "session_started": 50.0, "source": "local",
         "restart_after": "SIGKILL", "seconds": {"startup": 3.0, "compile": 1.0, "restore": 1.0}},
        {"event": "end", "step": 40, "time": 75.0, "stop_kind": "finished",
         "seconds": {"startup": 3.0, "compile": 1.0, "restore": 1.0, "save": 1.0}},
    ]


def test_wall_time_splits_into_steps_and_what_was_lost():
    result = goodput_of(_events())
    assert result.wall == 75.0 and len(result.sessions) == 2
    # Session 1: 40 s, 16 s measured (startup, compile, save, eval), 24 s over 30 steps; 10 of them redone.
    assert result.retrained_steps == 10 and abs(result.lost["retrained"] - 8.0) < 1e-9
    assert result.lost["down"] == 10.0 and result.lost["startup"] == 9.0 and result.lost["compile"] == 5.0
    assert result.lost["restore"] == 1.0 and result.lost["save"] == 3.0 and result.lost["eval"] == 4.0
    assert abs(result.productive - (75 - 9 - 5 - 1 - 3 - 4 - 10 - 8)) < 1e-9
    text = "\n".join(goodput_lines(result))
    assert "session 2, restarted after SIGKILL: resumed from step 20 (local), reached step 40" in text
    assert "retrained 10 steps, 8.0s" in text and "down 10.0s" in text and "retrained 8.0s" not in text


def test_steps_logged_after_a_sessions_last_event_are_retrained_not_down():
    """Killed after logging step 34 (its last event: step 30 at t=40): metrics.jsonl held step 34 when session 2
    started (reached_before). Those 4 steps ran in the 10 s gap at session 1's pace (0.8 s a step) and are
    computed again with the other 10."""
    events = _events()
    events[3]["reached_before"] = 34
    result = goodput_of(events)
    assert result.retrained_steps == 14 and abs(result.lost["retrained"] - 11.2) < 1e-9
    assert abs(result.lost["down"] - 6.8) < 1e-9
    text = "\n".join(goodput_lines(result))
    assert "retrained 14 steps, 11.2s" in text and "down 6.8s" in text
    assert "session 2, restarted after SIGKILL: resumed from step 20 (local), reached step 40" in text


def test_how_far_metrics_got_is_the_last_whole_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert last_logged_step(path) == 0  # no file yet
    lines = [json.dumps({"step": step, "split": "train", "loss": 1.0, "pad": "x" * 200}) for step in range(1, 400)]
    assert len("\n".join(lines)) > TAIL_BYTES  # only the tail is read
    path.write_text("\n".join(lines) + "\n" + '{"step": 400, "split": "tr')  # a line cut short by a kill
    assert last_logged_step(path) == 399


def test_time_spent_keeps_compiling_apart_from_the_activity_it_interrupts():
    compiled = [0.0]
    spent = TimeSpent(lambda: compiled[0])
    with spent.measure("eval"):
        compiled[0] = 1e6  # a compile "inside" the evaluation: far longer than the block took
    totals = spent.totals()
    assert totals["compile"] == 1e6 and totals["eval"] < 0  # the whole compile is taken out of eval


def test_inspect_goodput_reports_from_events_and_refuses_a_missing_directory(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(event) + "\n" for event in _events()))
    assert cli.main(["inspect", str(tmp_path), "--goodput"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("goodput ") and "over 2 session(s)" in out and "(local)" in out
    assert cli.main(["inspect", str(tmp_path / "missing"), "--goodput"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is not a directory" in err
