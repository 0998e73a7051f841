"""Context parallelism (``mesh.context``) on 8 simulated devices equals one device, and resumes bitwise.

One subprocess with 8 CPU devices trains a tiny scanned Llama with ``mesh.context=4 mesh.data=2`` on packed documents
(segment ids, positions restarting per document: RoPE), the same Llama in two pipeline stages with ``mesh.pipeline=2
mesh.context=2 mesh.data=2`` (the attention's collectives inside the stages' loop), a tiny GPT on plain windows (no
positions given: the model makes them) with ``mesh.context=2`` beside FSDP and tensor parallelism, scanned layers, full
remat and two micro-batches; two mixtures of experts on packed documents with ``mesh.context=2 mesh.expert=2
mesh.data=2`` (each device routes the tokens it holds, its experts' rows sent over ``expert``): GPT-OSS (Llama's
attention with sinks and a sliding window across the chunks, balanced over the global batch with aux and z losses) and
DeepSeek-V3 (latent attention, whose values are narrower than its queries and keys; a shared expert; the correction bias
moved by the step's global selection counts); then the packed Llama again, killed (SIGKILL) after a random step and
resumed, which must end bitwise equal to the uninterrupted run. This process trains the same runs on its one device; the
parameters after 3 steps (and the router metrics of every step) must agree within float32 rounding.
"""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import functrain
from examples import plain_functions
from functrain.checkpoint import load_params
from functrain.commands import cli
from functrain.errors import ConfigError
from functrain.data.token_store import StoreWriter
from functrain.models.splash import ordered_kernel
from functrain.parallel.context import context_inputs, load_balanced_order
from tests.conftest import REPO_ROOT, cli_env, max_abs_diff

TOLERANCE = 1e-5  # float32: only the order of cross-device sums differs
STEPS = 3

LLAMA = {"name": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "scan_layers": True}
GPT = {"name": "gpt", "vocab_size": 64, "max_len": 32, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64,
       "scan_layers": True, "remat": "full"}
GPT_OSS = {"name": "gpt_oss", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 8,
           "max_position_embeddings": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
           "output_router_logits": True, "router_aux_loss_coef": 0.1, "router_z_loss_coef": 0.01,
           "load_balance_scope": "global_batch"}
DEEPSEEK = {"name": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "moe_intermediate_size": 16, "num_hidden_layers": 1, "first_k_dense_replace": 0, "num_attention_heads": 4,
            "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 12,
            "bias_update_rate": 0.01, "router_z_loss_coef": 0.01, "max_position_embeddings": 64}
# Two sequences a device: the experts' [B, T] tokens split over the batch axes and context both.
MOE_MESH = {"mesh.context": 2, "mesh.expert": 2, "mesh.data": 2, "data.global_batch_size": 8}

RUNS = {  # name: (model, packing, the 8-device run's overrides; the reference takes those outside mesh.*)
    "llama_packed": (LLAMA, True, {"mesh.context": 4, "mesh.data": 2}),
    "llama_pipelined": (LLAMA, True, {"mesh.pipeline": 2, "mesh.context": 2, "mesh.data": 2}),
    "gpt_composed": (GPT, False, {"mesh.context": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "mesh.data": 1,
                                  "train.micro_batches": 2}),
    "gpt_oss_experts": (GPT_OSS, True, MOE_MESH),
    "deepseek_v3_experts": (DEEPSEEK, True, MOE_MESH),
}
SAME_REFERENCE = {"llama_pipelined": "llama_packed"}  # the same run on one device: trained once

# Trains the runs, then starts itself again to train the packed Llama into another directory and SIGKILL itself
# right after a random train call (2 or 3: a checkpoint of step 1 or 2 is the newest), then resumes that run here.
WORKER = r"""
import json, os, random, signal, subprocess, sys
import functrain
from functrain.run import jax_backend

runs, (killed_config, killed_overrides) = json.loads(sys.argv[1])
if "KILL_AT_CALL" in os.environ:
    calls, real_call = [0], jax_backend.JaxBackend.train_call
    def train_call(self, state, batches):
        result = real_call(self, state, batches)
        calls[0] += 1
        if calls[0] == int(os.environ["KILL_AT_CALL"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    jax_backend.JaxBackend.train_call = train_call
    functrain.fit(killed_config, **killed_overrides)
    sys.exit("the run was not killed")
for config, overrides in runs:
    functrain.fit(config, **overrides)
kill_at = random.randint(2, 3)
killed = subprocess.run([sys.executable, __file__, sys.argv[1]], env=dict(os.environ, KILL_AT_CALL=str(kill_at)))
assert killed.returncode == -signal.SIGKILL, killed.returncode
functrain.fit(killed_config, **killed_overrides)  # resumes from its newest checkpoint
print("killed after call", kill_at)
"""


def _config(tmp_path, name, model, packing, store):
    config = {
        "seed": 0,
        "model": model,
        "data": {"name": "tokens", "path": str(store), "seq_len": 32, "packing": packing,
                 "global_batch_size": 4, "eval_fraction": 0.0},
        # SGD: the params differ by the learning rate times the gradients' difference. AdamW's first update is
        # lr * g / (|g| + eps), which turns float32 rounding of a gradient near zero into a difference of lr.
        "optimizer": {"name": "sgd", "learning_rate": 1.0},
        "train": {"max_steps": STEPS, "steps_per_call": 1},
        "checkpoint": {"every_steps": STEPS, "async_save": False},
        "log": {"every_steps": 1, "progress": False, "tensorboard": False, "plot": False},
        "eval": {"every_steps": 0},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("context_parallel")
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 20, 200)  # documents shorter than a window: packing gives several segments a row
    with StoreWriter(root / "store", 64, {"name": "test", "xxh64": None, "eos_id": None}) as writer:
        writer.add(rng.integers(0, 64, int(lengths.sum())), lengths)
    configs = {name: _config(root, name, model, packing, root / "store") for name, (model, packing, _) in
               RUNS.items()}
    sharded = [[configs[name], {"run.dir": str(root / name), **mesh}] for name, (_, _, mesh) in RUNS.items()]
    killed = [configs["llama_packed"],
              {"run.dir": str(root / "killed"), "checkpoint.every_steps": 1, **RUNS["llama_packed"][2]}]
    (root / "worker.py").write_text(WORKER)
    worker = subprocess.Popen([sys.executable, str(root / "worker.py"), json.dumps([sharded, killed])],
                              cwd=REPO_ROOT, env=cli_env(8), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for name, (_, _, overrides) in RUNS.items():  # the references, on this process's one device, meanwhile
        if name in SAME_REFERENCE:
            continue
        same = {key: value for key, value in overrides.items() if not key.startswith("mesh.")}
        functrain.fit(configs[name], **{"run.dir": str(root / f"{name}_single"), "mesh.data": 1, **same})
    output, _ = worker.communicate(timeout=600)
    assert worker.returncode == 0, output
    return root, output


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", list(RUNS))
def test_context_parallel_training_matches_one_device(runs, name):
    root, _ = runs
    single_dir = root / f"{SAME_REFERENCE.get(name, name)}_single"
    single, sharded = _metrics(single_dir), _metrics(root / name)
    assert abs(single[-1]["loss"] - single[0]["loss"]) > 100 * TOLERANCE  # the params move: agreeing means something
    reference = load_params(str(single_dir), step=STEPS)
    assert max_abs_diff(reference, load_params(str(root / name), step=STEPS)) <= TOLERANCE
    # A mixture of experts' balancing terms are statistics of the whole global batch, whichever device routed what.
    router = [{key: value for key, value in step.items() if key.startswith("moe/")} for step in single]
    assert bool(router[0]) == ("num_experts_per_tok" in RUNS[name][0])  # the mixtures of experts log them
    for expected, step in zip(router, sharded):
        assert all(abs(step[key] - value) <= TOLERANCE for key, value in expected.items()), (expected, step)


def test_deepseek_correction_bias_moves_by_the_global_counts(runs):
    root, _ = runs
    bias = [load_params(str(root / run), step=STEPS)["moe_layers_0"]["e_score_correction_bias"]
            for run in ("deepseek_v3_experts_single", "deepseek_v3_experts")]
    assert np.abs(bias[0]).max() > 100 * TOLERANCE and np.abs(bias[0] - bias[1]).max() <= TOLERANCE


def test_context_parallel_run_killed_at_random_resumes_bitwise(runs):
    root, output = runs
    assert "killed after call" in output, output
    uninterrupted, resumed = load_params(str(root / "llama_packed")), load_params(str(root / "killed"))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(uninterrupted), jax.tree.leaves(resumed)))
    losses = [[json.loads(line)["loss"] for line in (root / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("llama_packed", "killed")]
    assert losses[0] == losses[1][-len(losses[0]):]


def test_load_balanced_order_pairs_a_chunk_from_each_end():
    assert load_balanced_order(16, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert load_balanced_order(8, 1).tolist() == list(range(8))


REFUSED = {  # config + overrides -> what the one line says
    "sequence_not_in_2C_chunks": (["configs/char_gpt.yaml", "data.seq_len=60", "mesh.context=4"],
                                  "data.seq_len=60 does not split into 2 x mesh.context=4 equal chunks"),
    "splash_blocks": (["configs/char_gpt.yaml", "model.attention=splash", "mesh.context=2"],
                      "leaves 32 tokens a device, which splash attention's 128-token blocks do not divide"),
    "torch_backend": (["configs/char_gpt_torch.yaml", "mesh.context=2"], "backend: jax only"),
    "model_without_the_hook": (["configs/mlp_digits.yaml", "mesh.context=2"], "and mlp has none"),
    "capacity_factor": (["configs/moe_char.yaml", "model.capacity_factor=1.0", "mesh.context=2"],
                        "mesh.context=2 with model.capacity_factor=1.0: each device routes two chunks"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_context_settings_are_one_line_exit_2_and_write_nothing(case, tmp_path, capsys):
    args, expected = REFUSED[case]
    run_dir = tmp_path / "run"
    assert cli.main(["train", *args, f"run.dir={run_dir}"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], lines
    assert not run_dir.exists()


def test_a_user_model_under_a_context_axis_is_refused(tmp_path):
    model = functrain.FunctionalModel(plain_functions.init, plain_functions.apply)
    data = {"x": np.zeros((64, 64), np.float32), "y": np.zeros(64, np.int32)}
    with pytest.raises(ConfigError, match="and a user model .* has none; set mesh.context=1"):
        functrain.fit(plain_functions.CONFIG, model=model, train_data=data,
                      **{"run.dir": str(tmp_path / "run"), "mesh.context": 2})
    assert not (tmp_path / "run").exists()


def test_data_of_another_length_than_the_config_says_is_refused_when_traced():
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("context",))):
        with pytest.raises(ConfigError, match="a sequence of 30 tokens does not split into 2 x mesh.context=2"):
            context_inputs(jnp.zeros((1, 30), jnp.int32), None, None)
        with pytest.raises(ConfigError, match="leaves 64 tokens a device, which splash attention's 128-token"):
            ordered_kernel(heads=1, length=128, shards=2, window=None, softcap=None)
