"""`functrain train --restarts N`: which endings start the run again, with what pause, and bad flags.

The supervisor's policy is checked here against a stand-in for the child process; the real restart (processes
killed, started again, resumed bitwise) is in tests/checkpoint/test_local_checkpoints.py.
"""

import os
import signal

import pytest

from functrain.commands import cli
from functrain.guards import restarts


class _Child:
    """A stand-in for the run's process: ends with the next of ``codes``."""

    codes: list[int] = []
    envs: list[dict] = []

    def __init__(self, command, env):
        assert command[1:3] == ["-m", "functrain"] and "--restarts" not in command
        _Child.envs.append(env)
        self.code = _Child.codes.pop(0)

    def wait(self):
        if self.code == "sigterm to the supervisor":
            os.kill(os.getpid(), signal.SIGTERM)  # runs the supervisor's handler, which passes it on here
            assert self.passed_on == signal.SIGTERM
            self.code = 75
        return self.code

    def send_signal(self, signum):
        self.passed_on = signum

    def poll(self):
        return None  # running, as far as a signal handler can tell


@pytest.fixture
def children(monkeypatch):
    pauses = []
    monkeypatch.setattr(restarts.subprocess, "Popen", _Child)
    monkeypatch.setattr(restarts.time, "sleep", pauses.append)
    _Child.envs = []

    def run(codes, restarts_allowed=3):
        _Child.codes = list(codes)
        status = restarts.run_with_restarts(["train", "c.yaml"], restarts_allowed, 2.0)
        return status, len(_Child.envs), pauses

    return run


@pytest.mark.parametrize("code", [0, 2, 3, 4])
def test_finished_bad_input_and_nonfinite_runs_are_not_restarted(children, code):
    assert children([code, 0]) == (code, 1, [])


def test_crashes_kills_and_preemptions_restart_with_a_doubling_pause(children, capsys):
    status, attempts, pauses = children([-signal.SIGKILL, 75, 1, 0])
    assert (status, attempts, pauses) == (0, 4, [2.0, 4.0, 8.0])
    assert [env.get(restarts.ENV_PREVIOUS_EXIT) for env in _Child.envs] == [None, "SIGKILL", "status 75", "status 1"]
    assert "the run ended with SIGKILL; restarting in 2s (restart 1 of 3)" in capsys.readouterr().err


def test_a_stop_signal_to_the_supervisor_goes_to_the_run_and_ends_the_job(children):
    assert children(["sigterm to the supervisor", 0]) == (75, 1, [])


def test_the_last_allowed_attempt_ends_the_job_with_its_status(children, capsys):
    assert children([-signal.SIGKILL, -signal.SIGKILL], restarts_allowed=1)[:2] == (128 + signal.SIGKILL, 2)
    assert "no restarts left" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [(["--restarts", "-1"], "--restarts -1"),
                                          (["--restarts", "1", "--restart-delay", "-5"], "--restart-delay -5")])
def test_negative_restarts_or_delay_is_one_line_and_exit_2(capsys, flags, named):
    assert cli.main(["train", "configs/mlp_digits.yaml", *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and named in err
