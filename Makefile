# Two commands on a fresh machine:  make train  /  make test
# Both create and reuse .venv/ in the repo root.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Every install of the setup goes through tools/install.py: uv where it can be had (installed into the venv by
# pip, once), else pip, with pip's own configuration either way. pip alone took about 50 s of a fresh `make test` on
# the 2-core machine, uv 12 (idle; 28-38 under load). Neither byte-compiles what it installs (pip is given
# --no-compile): byte-compiling every module of every installed package (torch, transformers, libtpu, ...) was most
# of the install's time; Python compiles the modules a process imports, once.
INSTALL := $(PY) tools/install.py
# ... which needs Python to write the bytecode it compiles: a PYTHONDONTWRITEBYTECODE in the caller's environment
# made every process of the suite compile jax, flax and transformers again (a fresh `make test`: its subprocess
# tests 35% slower, 10.2 minutes in all on the 2-core machine). The venv and the checkout ignore their __pycache__.
unexport PYTHONDONTWRITEBYTECODE
# The setup writes nothing outside .venv/ (and pip's and uv's caches) but Python's own __pycache__: the editable install
# builds without isolation, with the setuptools the venv gets first (an isolated build runs setuptools' egg_info in
# the checkout, which left a functrain.egg-info there; tests/commands/test_setup.py); ruff's, mypy's and pytest's
# caches are in .venv/ (pyproject.toml); the tests keep their files in a folder of the session, removed at its end
# (tests/conftest.py).
EDITABLE := --no-build-isolation --editable
CONFIG ?= configs/char_gpt.yaml
ARGS ?=

.PHONY: train train-tokens ruff lint test bench clean-venv

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(INSTALL) --upgrade pip "setuptools>=77"  # pyproject.toml's build backend, for the editable install

# Core install: everything `make train` needs (no torch).
$(VENV)/.core: pyproject.toml | $(VENV)/bin/python
	$(INSTALL) $(EDITABLE) .
	touch $@

# Test install: the torch bridge, HF conversion, libtpu (plan --topology tests), qwix (QLoRA) and test tools. Torch comes first so that the CPU
# build is chosen where no GPU is present (an unpinned torch would pull several GB of CUDA packages).
$(VENV)/.dev: $(VENV)/.core tools/install_torch.sh
	sh tools/install_torch.sh $(PY)
	$(INSTALL) $(EDITABLE) ".[torch,hf,dev,tpu,eval,quant]"
	touch $@

train: $(VENV)/.core
	$(VENV)/bin/functrain train $(CONFIG) $(ARGS)

# A packed GPT on a token store of Python's own standard-library sources (tokenized once, UTF-8 bytes).
runs/stdlib_tokens: | $(VENV)/.core
	$(VENV)/bin/functrain tokenize $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/*.py $@

train-tokens: runs/stdlib_tokens
	$(VENV)/bin/functrain train configs/gpt_tokens.yaml $(ARGS)

# Static checks (pyproject.toml configures them): lint, formatting, types. Seconds once mypy's cache (in .venv/) is
# warm.
LINTED := functrain torch_bridge
ruff: $(VENV)/.dev
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

lint: ruff
	$(VENV)/bin/mypy

# The tests' temporary files (run directories, checkpoints, the session's XLA cache) go to memory where /dev/shm has
# room (over 4 GB free): the checkpoint tests' synced writes wait on no disk (about 15% of their time here).
TEST_TMPDIR := $(shell df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 && $$4 > 4000000 {print "/dev/shm"}')

# mypy runs beside the tests, not before them: it is one process on one core (about 22 s from a fresh clone, its cache
# cold), which left the other core idle. Its report follows the tests'; either failing fails the target.
test: ruff
	@$(VENV)/bin/mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(if $(TEST_TMPDIR),TMPDIR=$(TEST_TMPDIR)) $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests; \
	tests=$$?; wait $$mypy; types=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 && test $$types -eq 0

bench: $(VENV)/.dev
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-venv:
	rm -rf $(VENV)
