#!/bin/bash
# The checks a GPU machine is lent for, in one short run (the device tool of this workplace runs it from the repo
# root; OUT is a folder whose files come back). That machine has its own python3 with jax[cuda], flax, optax and
# orbax but no registry: the packages it lacks travel as wheels in .whl/ (downloaded here for CPython 3.12).
#   1. bench/bench_mfu.py on configs/gpt_350m.yaml (MFU, functrain vs hand-written, remat and offload variants);
#   2. `functrain train` of the default job, briefly, on the GPU (the whole path: data, step, Orbax, summary);
#   3. `functrain verify-resume` of it: is a killed and resumed GPU run bitwise the uninterrupted one?
set -o pipefail
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import jax, flax, optax, orbax.checkpoint as ocp; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, 'orbax', ocp.__version__, jax.devices())"
timeout 330 python3 bench/bench_mfu.py --calls 6 2>&1 | tee "$OUT/bench_mfu.txt"
echo "== rc $?"
timeout 90 python3 -m functrain train configs/char_gpt.yaml train.max_steps=300 run.dir=/tmp/runs/char_gpt \
    2>&1 | tee "$OUT/train.txt" | tail -20
echo "== rc $?"
timeout 120 python3 -m functrain verify-resume configs/char_gpt.yaml --steps 60 run.dir=/tmp/runs/verify \
    2>&1 | tee "$OUT/verify_resume.txt" | tail -12
echo "== rc $?"
