"""Goodput from events.jsonl: the arithmetic on made-up events, and the events a real run writes."""

import json

from functrain.commands import cli
from functrain.callbacks.time_spent import TimeSpent
from functrain.report.goodput import goodput_of, goodput_lines


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
    assert "retrained 8.0s (10 steps)" in text and "down 10.0s" in text


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
