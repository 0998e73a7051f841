"""Shared test helpers.

Multi-device and multi-process tests run in a subprocess so XLA_FLAGS (which must be set before jax is
imported) never leak into the rest of the suite.
"""

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

# Torch's OpenMP threads (and numpy's OpenBLAS ones) one per process: the two xdist workers already fill the two cores,
# and a worker's idle threads spin waiting for a peer the other worker holds off its core (the torch-heavy modules
# took 40-61 s of CPU with the default threads, 30 s with one). Set before torch or numpy is imported; every process
# the tests start inherits it (the runs they compare bitwise were on one thread already). A value the caller set wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from functrain.parallel.platform import choose_platforms

choose_platforms()  # before jax: the suite starts no libtpu where no TPU is attached (the tpu extra installs it)

# The suite's CPU programs are compiled without LLVM's optimisation passes and with XLA:CPU's older loop emitters
# instead of its MLIR fusion emitters: XLA's own HLO passes (fusion, layout, sharding) all still run, and no pass that
# changes float results is skipped (XLA:CPU turns fast-math off), so every comparison a test makes holds alike. Most of
# the suite's time is compiling small programs that run for milliseconds: the optimisation level cuts its CPU time by
# about a quarter, the emitters by another quarter (tests/models: 19.4-20.4 -> 14.9 s of CPU). Every process the
# tests start inherits them (xla_flags). A value the caller set wins.
_TEST_COMPILE_FLAGS = {"--xla_backend_optimization_level": "0", "--xla_cpu_use_fusion_emitters": "false"}
for _flag, _value in _TEST_COMPILE_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}={_value}".strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Python's cyclic garbage collector, run less often in the test workers: a worker holds every module's traced and
# compiled programs, so each full collection walks a large heap, and tracing allocates fast (collections were 9% of
# the tracing-heavy modules' CPU; 7-9% less CPU in all with these thresholds). Only when cycles are freed changes:
# a worker's peak memory is the same (test_grpo_run.py: 734 MB before, 733 after).
gc.set_threshold(50_000, 20, 100)

REPO_ROOT = Path(__file__).resolve().parents[1]
# Everything the session writes outside the tests' own directories goes under one directory of the session, so that
# `make test` leaves nothing behind (outside .venv/): its temporary files (TMPDIR, pytest's tmp_path among them), the
# caches and settings libraries keep under XDG_CACHE_HOME / XDG_CONFIG_HOME / XDG_DATA_HOME (matplotlib's font list,
# HF datasets' cache, wandb's logs, mlflow's telemetry) and the XLA cache below. Removed when the session ends; its
# temporary files are kept when a test failed (pytest keeps a failed test's tmp_path). The first process to import
# this file (the controller) names the directory; the workers and every subprocess inherit the name, also a
# subprocess that imports this file (a test's helper module imports it: its own pid, or its parent's, named a cache
# of its own that compiled everything again).
SESSION_DIR = Path(os.environ.setdefault(
    "FUNCTRAIN_TESTS_DIR", str(Path(tempfile.gettempdir()) / f"functrain-tests-{os.getpid()}")))
(SESSION_DIR / "tmp").mkdir(parents=True, exist_ok=True)
SESSION_OWN = {"TMPDIR": "tmp", "XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config", "XDG_DATA_HOME": "data",
               "WANDB_CACHE_DIR": "cache/wandb", "WANDB_CONFIG_DIR": "config/wandb", "WANDB_DATA_DIR": "data/wandb"}
os.environ.update({name: str(SESSION_DIR / folder) for name, folder in SESSION_OWN.items()})
tempfile.tempdir = None  # tempfile reads TMPDIR again
# One persistent XLA compilation cache for the whole test session: every xdist worker and every subprocess (they
# inherit the environment) reads and writes it, so the many runs of the same small programs, in-process or in a
# fresh interpreter, compile once. A cache hit is the executable the compiler would produce, so results stay
# bitwise the same.
SESSION_XLA_CACHE = SESSION_DIR / "xla"
SESSION_CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR": str(SESSION_XLA_CACHE),
                     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
os.environ.update(SESSION_CACHE_ENV)
jax.config.update("jax_compilation_cache_dir", str(SESSION_XLA_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# torch.compile's kernel cache, one per CPU capability: inductor's cache key leaves ATEN_CPU_CAPABILITY out, so a
# run emulating an older CPU (ATEN_CPU_CAPABILITY=avx2) would load kernels compiled for this one's AVX-512 and fail.
# Kept between sessions in the virtual environment the tests run in (`make clean-venv` removes it): compiled cold,
# test_torch_user_model.py's torch.compile test takes 14 s more CPU. Outside a virtual environment, the session's.
_KEPT = Path(sys.prefix) / "cache" if sys.prefix != sys.base_prefix else SESSION_DIR
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(
    _KEPT / f"functrain-tests-inductor-{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}"))


# The longest modules, longest first (by each module's CPU time, its subprocesses' included, profiled over the whole
# suite; together about 70% of it; test_torch_user_model.py by its time on a fresh machine, where torch.compile's
# kernel cache is cold). xdist hands whole modules to its two workers (--dist loadfile) in collection order
# (--no-loadscope-reorder: by default it orders them by their number of tests, which put several long modules of few
# tests last), so a long module started late would leave one worker running alone at the end. Started first, the
# short ones fill the gaps.
LONGEST_MODULES = (
    "plan/test_plan.py",
    "parallel/test_pipeline.py",
    "models/test_deepseek_v3.py",
    "models/test_qwen3_next.py",
    "torch_bridge/hf/test_hf_qwen3_next.py",
    "parallel/test_context_parallel.py",
    "run/test_multiprocess.py",
    "tasks/grpo/test_grpo_run.py",
    "tasks/distill/test_distill_run.py",
    "tasks/test_model_terms_every_task.py",
    "models/test_recent_families.py",
    "models/moe/test_moe_models.py",
    "commands/test_moe_commands.py",
    "tasks/grpo/test_grpo_processes.py",
    "tasks/preference/test_preference.py",
    "core/test_user_models.py",
    "torch_bridge/test_torch_user_model.py",
    "tasks/grpo/test_grpo_shared_prefix.py",
    "run/test_fp8_training.py",
    "models/test_qlora.py",
    "run/test_token_training.py",
    "core/test_data_fields.py",
    "torch_bridge/test_torch_resume.py",
    "run/test_resume_bitwise.py",
    "models/test_scan_layers.py",
    "models/test_lora.py",
    "run/test_run_outcome.py",
    "run/test_loop.py",
    "text/test_harness.py",
    "checkpoint/test_checkpoint_integrity.py",
    "text/test_generate.py",
    "torch_bridge/test_torch_transformers.py",
    "plan/test_multislice.py",
    "models/moe/test_expert_parallel.py",
    "report/test_mfu.py",
    "run/test_backend_parity.py",
    "models/test_splash_attention.py",
    "commands/test_verify_resume.py",
    "tasks/preference/test_preference_trl.py",
    "tasks/distill/test_distill_program.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {f"tests/{module}": place for place, module in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


def pytest_sessionfinish(session, exitstatus):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        kept = [SESSION_DIR / "tmp"] if exitstatus != 0 else []  # a failed test's tmp_path, to look at
        for path in SESSION_DIR.iterdir():
            if path not in kept:
                shutil.rmtree(path, ignore_errors=True)
        if not kept:
            shutil.rmtree(SESSION_DIR, ignore_errors=True)


def xla_flags(devices: int | None = None) -> str:
    """The XLA_FLAGS of a subprocess: this process's, so a cap such as ``--xla_cpu_max_isa=AVX2`` (the suite run
    as on an older CPU) reaches every process, with ``devices`` simulated CPU devices in place of its device
    count (None: the platform's one device)."""
    count = "--xla_force_host_platform_device_count"
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if not flag.startswith(count)]
    return " ".join(flags + ([] if devices is None else [f"{count}={devices}"]))


def cli_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a subprocess that runs this checkout on CPU: ``devices`` simulated CPU devices
    (None: the platform's one device) and the session's compilation cache (inherited), plus ``extra`` variables."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices), **extra)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_python(code: str, devices: int = 1, env: dict | None = None, timeout: float = 300,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``devices`` simulated CPU devices; return the process."""
    full_env = cli_env(devices, **(env or {}))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO_ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def max_abs_diff(a, b) -> float:
    """The largest |a - b| over the leaves of two pytrees of the same structure (in float64)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def free_port() -> int:
    """A TCP port nothing listens on now, for a test's process coordinator."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_jax_processes(code: str, processes: int = 2, devices: int = 2, env: dict | None = None,
                      timeout: float = 180) -> list[dict]:
    """Run ``code`` in ``processes`` fresh interpreters of ``devices`` CPU devices each, with ``PORT`` (a free
    coordinator port) and ``PROCESS_ID`` in their environment for ``jax.distributed.initialize``; return the
    JSON object each printed on a line starting with ``RESULT``."""
    port = free_port()
    workers = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, text=True,
                                env=cli_env(devices, PORT=str(port), PROCESS_ID=str(process_id), **(env or {})),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for process_id in range(processes)]
    results = []
    try:
        for worker in workers:
            stdout, stderr = worker.communicate(timeout=timeout)
            assert worker.returncode == 0, f"worker failed:\n{stdout}\n{stderr}"
            results.append(json.loads(next(line for line in stdout.splitlines()
                                           if line.startswith("RESULT"))[len("RESULT "):]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    return results


@pytest.fixture
def python_runner():
    """The ``run_python`` helper as a fixture."""
    return run_python


@pytest.fixture
def compilation_cache():
    """The environment variables that point a process at the session's persistent compilation cache (this
    process and every subprocess use it already: a test passes them on to make that explicit where a program
    runs in several processes and relies on compiling once)."""
    return dict(SESSION_CACHE_ENV)
