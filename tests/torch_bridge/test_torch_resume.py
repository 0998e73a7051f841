"""Command-line runs with ``backend: torch``: a SIGKILLed and resumed run ends bit-identical to an
uninterrupted one; ``import functrain`` never needs torch."""

import re
import signal
import subprocess
import sys
import time

import torch
from pathlib import Path

from tests.conftest import cli_env
from functrain.checkpoint.layout import checkpoints_dir, committed_steps
from functrain.commands.cli import main

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY = 300, 100
TIMINGS = r', "[a-z_]*(per_sec|mfu)[a-z_]*": [^,}]*'  # throughput fields differ between runs


def _env() -> dict:
    return cli_env(OMP_NUM_THREADS="1")


def _overrides(run_dir: Path) -> list[str]:
    return [f"run.dir={run_dir}", "train.epochs=null", f"train.max_steps={STEPS}", "train.steps_per_call=1",
            f"checkpoint.every_steps={EVERY}", "checkpoint.keep=2", "log.every_steps=20", "eval.every_steps=0",
            "log.progress=false", "log.tensorboard=false"]


def _train(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "functrain", "train", "configs/mlp_digits_torch.yaml",
                             *_overrides(run_dir)], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _digest(run_dir: Path, capsys) -> tuple[int, str]:
    # `functrain inspect --digest` through the CLI's entry point, in this process (no interpreter start-up).
    assert main(["inspect", str(run_dir), "--digest"]) == 0
    out = capsys.readouterr().out
    match = re.search(r"sha256 step (\d+): ([0-9a-f]{64})", out)
    assert match, out
    return int(match.group(1)), match.group(2)


def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, capsys):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    killed_run = _train(interrupted)
    deadline = time.monotonic() + 180
    while not committed_steps(checkpoints_dir(interrupted)) and killed_run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    killed_run.send_signal(signal.SIGKILL)
    output, _ = killed_run.communicate(timeout=60)
    assert killed_run.returncode == -signal.SIGKILL, f"the run ended before it could be killed:\n{output}"
    saved = committed_steps(checkpoints_dir(interrupted))
    assert saved and STEPS not in saved

    resumed = _train(interrupted)
    # The uninterrupted run in this process (the CLI's entry point) while the resumed one trains in its own.
    assert main(["train", "configs/mlp_digits_torch.yaml", *_overrides(reference)]) == 0
    resumed_out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, resumed_out
    assert f"resumed from checkpoint {saved[-1]} " in resumed_out
    capsys.readouterr()
    assert _digest(reference, capsys) == _digest(interrupted, capsys)
    last = lambda run: [line for line in (run / "metrics.jsonl").read_text().splitlines()  # noqa: E731
                        if '"split": "train"' in line][-1]
    assert re.sub(TIMINGS, "", last(reference)) == \
        re.sub(TIMINGS, "", last(interrupted))


# One interpreter for both checks: first with torch installed and importable, importing functrain (its run loop,
# builder, backends and config) loads neither torch nor the bridge; then, with torch hidden as on a machine without
# it, the bridge and the torch backend refuse with the install advice. (A functrain module that imported torch,
# even inside a try, would show in the first check: hiding torch first finds nothing more.)
WITHOUT_TORCH = """
import sys
import functrain, functrain.run.loop, functrain.run.build, functrain.run.backends, functrain.config.load
print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_bridge')))
class HideTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
sys.meta_path.insert(0, HideTorch())
try:
    import torch_bridge
except ImportError as error:
    assert "tools/install_torch.sh" in str(error) and "functrain[torch]" in str(error), error
else:
    raise AssertionError("torch_bridge imported without torch")
config = functrain.config.load.load_config("configs/mlp_digits_torch.yaml")
try:
    functrain.run.backends.torch_backend(config, {}, 1)
except functrain.errors.ConfigError as error:
    assert "tools/install_torch.sh" in str(error) and "functrain[torch]" in str(error), error
else:
    raise AssertionError("backend: torch worked without torch")
print("ok")
"""


def test_functrain_imports_without_torch(python_runner):
    assert python_runner(WITHOUT_TORCH).stdout.splitlines() == ["[]", "ok"]


def test_lion_with_bfloat16_moments_on_packed_tokens_resumes_bitwise(tmp_path):
    """What the twin used to drop or refuse (lion, optimizer.mu_dtype, packed segments) runs on torch, and its
    bfloat16 moments go through checkpoints bit for bit: stopped at step 3 and rerun, the run ends where an
    uninterrupted one does."""
    import numpy as np
    from functrain import fit
    from functrain.checkpoint import load_params
    from functrain.core.tree import flatten_dotted
    from functrain.data.token_store import StoreWriter
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 10, 300).tolist()
    with StoreWriter(tmp_path / "store", 32, {"name": "test", "xxh64": None, "eos_id": None}) as writer:
        writer.add(rng.integers(0, 32, sum(lengths)), lengths)
    config = {"backend": "torch", "seed": 0,
              "model": {"name": "gpt", "vocab_size": 32, "max_len": 12, "d_model": 16, "n_layers": 1, "n_heads": 2,
                        "d_ff": 32},
              "data": {"name": "tokens", "path": str(tmp_path / "store"), "seq_len": 12, "global_batch_size": 4,
                       "packing": True, "eval_fraction": 0.0},
              "optimizer": {"name": "lion", "learning_rate": 1e-3, "mu_dtype": "bfloat16"},
              "train": {"max_steps": 6}, "checkpoint": {"every_steps": 3},
              "log": {"every_steps": 3, "progress": False, "trackers": ["jsonl"]}}
    whole = fit(config, **{"run.dir": str(tmp_path / "whole")})
    fit(config, **{"run.dir": str(tmp_path / "split"), "train.max_steps": 3})
    resumed = fit(config, **{"run.dir": str(tmp_path / "split")})
    assert whole.step == resumed.step == 6
    moments = whole.state.opt_state["mu"]
    assert {value.dtype for value in moments.values()} == {torch.bfloat16}
    reference, continued = load_params(tmp_path / "whole"), load_params(tmp_path / "split")
    reference, continued = flatten_dotted(reference), flatten_dotted(continued)
    assert sorted(reference) == sorted(continued)
    for name, value in reference.items():
        assert np.array_equal(value, continued[name]), name
