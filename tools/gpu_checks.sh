#!/bin/bash
# The checks a GPU machine is lent for, in one short run (the device tool of this workplace runs it from the repo
# root; OUT is a folder whose files come back). That machine has its own python3 with jax[cuda], flax, optax and
# orbax but no registry: the packages it lacks travel as wheels in .whl/ (downloaded here for CPython 3.12).
#   tools/gpu_checks.sh [BUDGET_S] [CHECK...]   checks run in the order given; default: grpo mfu
#   train   `functrain train` of the default job, briefly (the whole path: data, step, Orbax, summary);
#   resume  `functrain verify-resume` of it: is a killed and resumed GPU run bitwise the uninterrupted one?
#   grpo    the GRPO example from that run: rollout/logprob_gap with float32 products (train.matmul_precision
#           auto) and XLA's default (TF32) ones, and verify-resume of a GRPO run;
#   mfu     bench/bench_mfu.py on configs/gpt_350m.yaml with what is left of BUDGET_S (default 560 s):
#           deterministic=false (cuDNN attention, chunked logits as a run's auto) against hand-written Flax + optax
#           and against the whole logits, each compiled once (about 100 s each).
#   fp8     bench/bench_mfu.py on bench/llama3_1b.yaml (a Llama 3-style 1B, 16k tokens a step): bfloat16 against
#           train.fp8, both with deterministic=false's kernels, tokens/s and MFU against the bf16 peak (target: FP8
#           >= 1.2x bf16); two compiles of a minute or two, 5 timed calls each. FP8_BENCH_ARGS replaces the
#           config (e.g. "--preset cpu --calls 1" with FP8_BENCH_VARIANTS=functrain,fp8: the toy run on a CPU).
set -o pipefail
OUT=${OUT:-/tmp/gpu_checks}
BUDGET=${1:-560}
[ $# -gt 0 ] && shift
CHECKS=("$@")
[ ${#CHECKS[@]} -eq 0 ] && CHECKS=(grpo mfu)
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import jax, flax, optax, orbax.checkpoint as ocp; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, 'orbax', ocp.__version__, jax.devices())"

left() { echo $((BUDGET - SECONDS)); }

base_run() {  # make train's job, the GRPO example's starting weights
    [ -d /tmp/runs/char_gpt/checkpoints ] && return
    timeout 120 python3 -m functrain train configs/char_gpt.yaml train.max_steps=300 run.dir=/tmp/runs/char_gpt \
        2>&1 | tee "$OUT/train.txt" | tail -5
    echo "== train rc $?"
}

gap_summary() {  # the run's rollout/logprob_gap and reward from its metrics.jsonl
    python3 - "$1" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
rows = [row for row in rows if row.get("split") == "train" and "rollout/logprob_gap" in row]
gaps = [row["rollout/logprob_gap"] for row in rows]
print(f"{sys.argv[1]}: {len(rows)} steps, rollout/logprob_gap max {max(gaps):.3g} min {min(gaps):.3g} "
      f"last {gaps[-1]:.3g}; zero at {sum(g == 0 for g in gaps)} steps; reward {rows[0]['reward']:.3f} -> "
      f"{rows[-1]['reward']:.3f}")
EOF
}

for check in "${CHECKS[@]}"; do
    case $check in
    train) base_run ;;
    resume)
        timeout 120 python3 -m functrain verify-resume configs/char_gpt.yaml --steps 60 run.dir=/tmp/runs/verify \
            2>&1 | tee "$OUT/verify_resume.txt" | tail -12
        echo "== verify-resume rc $?" ;;
    grpo)
        base_run
        timeout 150 python3 -m functrain train configs/grpo_char_gpt.yaml train.init_from=/tmp/runs/char_gpt \
            run.dir=/tmp/runs/grpo 2>&1 | tee "$OUT/grpo.txt" | tail -4
        echo "== grpo rc $?"
        gap_summary /tmp/runs/grpo | tee -a "$OUT/grpo.txt"
        timeout 90 python3 -m functrain train configs/grpo_char_gpt.yaml train.init_from=/tmp/runs/char_gpt \
            train.max_steps=30 train.matmul_precision=default run.dir=/tmp/runs/grpo_tf32 2>&1 \
            | tee "$OUT/grpo_tf32.txt" | tail -3
        echo "== grpo tf32 rc $?"
        gap_summary /tmp/runs/grpo_tf32 | tee -a "$OUT/grpo_tf32.txt"
        timeout 150 python3 -m functrain verify-resume configs/grpo_char_gpt.yaml --steps 6 \
            train.init_from=/tmp/runs/char_gpt run.dir=/tmp/runs/grpo_verify 2>&1 \
            | tee "$OUT/grpo_verify_resume.txt" | tail -8
        echo "== grpo verify-resume rc $?" ;;
    mfu)
        echo "mfu: $(left) s left"
        timeout "$(left)" python3 bench/bench_mfu.py --calls 5 \
            --variants deterministic=false,hand-written,logits_chunk=off 2>&1 \
            | tee "$OUT/bench_mfu.txt"
        echo "== bench_mfu rc $?" ;;
    fp8)
        echo "fp8: $(left) s left"
        # shellcheck disable=SC2086  # FP8_BENCH_ARGS is a list of arguments
        timeout "$(left)" python3 bench/bench_mfu.py ${FP8_BENCH_ARGS:---config bench/llama3_1b.yaml --calls 5} \
            --variants "${FP8_BENCH_VARIANTS:-deterministic=false,fp8}" 2>&1 | tee "$OUT/bench_fp8.txt"
        echo "== bench_fp8 rc $?" ;;
    *) echo "unknown check $check (train, resume, grpo, mfu, fp8)"; exit 2 ;;
    esac
    echo "-- $check done at ${SECONDS} s"
done
