"""User ``nn.Module``s through the torch bridge: tied weights, BatchNorm state, bfloat16, user losses, bad input."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import functrain
from functrain.callbacks.base import Callback, Control
from functrain.checkpoint import Checkpointer
from functrain.checkpoint.layout import checkpoints_dir, committed_steps
from functrain.config.load import load_config
from functrain.errors import CheckpointError, ConfigError
from functrain.run.backends import torch_backend as make_backend
from torch_bridge.models import stateless
from torch_bridge.user_model import build_module

REPO = Path(__file__).resolve().parents[2]
FAST = ["train.epochs=null", "train.max_steps=12", "train.steps_per_call=3", "log.every_steps=3",
        "eval.every_steps=0", "checkpoint.every_steps=6", "log.progress=false", "log.tensorboard=false",
        "checkpoint.async_save=false", "data.prefetch=0", "optimizer.schedule=constant",
        "optimizer.warmup_steps=0"]


class DigitsCNN(nn.Module):
    """Conv + BatchNorm + pooling on the 8x8 digits: running statistics are buffers the step updates."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm(self.conv(x.view(-1, 1, 8, 8))))
        return self.head(F.max_pool2d(h, 2).flatten(1))


def _digits_config(run_dir: Path, *overrides: str):
    return load_config(REPO / "configs" / "mlp_digits_torch.yaml", [f"run.dir={run_dir}", *FAST, *overrides])


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(path.relative_to(run_dir)): path.read_bytes() for path in sorted(run_dir.rglob("*")) if path.is_file()}


def _tiny_gpt2() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def _tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0))


@pytest.mark.parametrize("factory", [_tiny_gpt2, _tiny_llama])
def test_tied_weights_stay_tied_like_functional_call(factory):
    """New parameters for a tied model: logits and gradients equal torch.func.functional_call's."""
    model = build_module(factory, seed=0).eval()
    params = {name: value.detach() + 0.05 * torch.randn_like(value) for name, value in model.named_parameters()}
    buffers = dict(model.named_buffers())
    tied = "transformer.wte.weight" if "transformer.wte.weight" in params else "model.embed_tokens.weight"
    assert model.lm_head.weight is model.get_parameter(tied) and "lm_head.weight" not in params
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))

    def logits_and_grad(call):
        leaves = {name: value.clone().requires_grad_() for name, value in params.items()}
        logits = call(leaves).logits
        return logits, torch.autograd.grad(logits.square().sum(), leaves[tied])[0]

    ours, our_grad = logits_and_grad(lambda leaves: stateless(model)(leaves, buffers, tokens))
    reference, reference_grad = logits_and_grad(
        lambda leaves: torch.func.functional_call(model, (leaves, buffers), (tokens,), tie_weights=True))
    assert torch.equal(ours, reference) and torch.equal(our_grad, reference_grad)
    # The swap is undone: the module's own head is its own embedding again, not the last call's tensor.
    assert model.lm_head.weight is model.get_parameter(tied)


def test_batchnorm_cnn_updates_its_buffers_and_resumes_bitwise(tmp_path):
    """A stop-and-save at step 6 then a resume ends bit-identical to 12 uninterrupted steps, buffers included."""
    class StopAt(Callback):
        def on_step_end(self, view):
            return Control(should_stop=True, should_save=True) if view.step == 6 else None

    fresh = build_module(DigitsCNN, seed=0)
    whole = functrain.fit(_digits_config(tmp_path / "whole"), model=build_module(DigitsCNN, seed=0))
    first = functrain.fit(_digits_config(tmp_path / "parts"), callbacks=[StopAt()],
                          model=build_module(DigitsCNN, seed=0))
    assert first.step == 6
    resumed = functrain.fit(_digits_config(tmp_path / "parts"), model=build_module(DigitsCNN, seed=1))
    assert resumed.step == 12 and committed_steps(checkpoints_dir(tmp_path / "parts")) == [6, 12]

    assert not torch.equal(whole.state.buffers["norm.running_mean"], fresh.norm.running_mean)
    assert int(whole.state.buffers["norm.num_batches_tracked"]) == 12
    for table in ("params", "buffers"):
        ours, theirs = getattr(whole.state, table), getattr(resumed.state, table)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), table
    assert all(torch.equal(whole.state.opt_state["mu"][k], resumed.state.opt_state["mu"][k])
               for k in whole.state.params)
    # The statistics are in the checkpoint's model state.
    backend = make_backend(_digits_config(tmp_path / "parts"), {"x": np.zeros((2, 64), np.float32),
                           "y": np.zeros(2, np.int32), "weight": np.ones(2, np.float32)}, 12, model=DigitsCNN())
    with Checkpointer(tmp_path / "parts", async_save=False) as checkpointer:
        items, _, _ = checkpointer.restore(backend.restore_targets())
    assert np.array_equal(items["state"]["model_state"]["norm"]["running_var"],
                          resumed.state.buffers["norm.running_var"].numpy())


def test_bfloat16_autocast_trains_with_float32_master_params(tmp_path):
    rng = np.random.default_rng(0)
    batch = {"x": rng.random((64, 64), dtype=np.float32), "y": rng.integers(0, 10, 64).astype(np.int32),
             "weight": np.ones(64, np.float32)}
    losses = {}
    for dtype in ("float32", "bfloat16"):
        config = _digits_config(tmp_path, f"train.compute_dtype={dtype}", "optimizer.learning_rate=0.01")
        backend = make_backend(config, batch, 12, model=build_module(DigitsCNN, seed=0))
        # Eight steps on the same batch: the loss must fall.
        state, metrics = backend.train_call(backend.init_state(), {k: np.stack([v] * 8) for k, v in batch.items()})
        losses[dtype] = metrics["loss"]
        assert all(value.dtype == torch.float32 for value in state.params.values())
        assert metrics["loss"][-1] < 0.9 * metrics["loss"][0]
    assert not torch.equal(losses["float32"], losses["bfloat16"])  # the forward really ran in bfloat16
    assert torch.allclose(losses["float32"], losses["bfloat16"], rtol=0.05)


def test_user_loss_replaces_the_builtin_and_is_checked(tmp_path):
    def mean_squared_margin(model, batch, generator):
        logits = model(batch["x"])
        per_example = (logits - F.one_hot(batch["y"].long(), 10)).square().sum(-1)
        return (per_example * batch["weight"]).sum(), batch["weight"].sum(), {"margin": logits.std(-1).sum()}

    result = functrain.fit(_digits_config(tmp_path / "run", "train.max_steps=6"),
                           model=build_module(DigitsCNN, seed=0), loss_fn=mean_squared_margin)
    assert "margin" in result.metrics["train"] and "accuracy" not in result.metrics["train"]

    def returns_a_mean(model, batch, generator):
        return F.cross_entropy(model(batch["x"]), batch["y"].long())
    with pytest.raises(ConfigError, match="returns_a_mean must return .loss_sum, weight_sum, aux_dict."):
        functrain.fit(_digits_config(tmp_path / "other"), model=DigitsCNN(), loss_fn=returns_a_mean)
    assert not (tmp_path / "other").exists()


def test_bad_user_modules_fail_in_one_line_and_keep_the_run(tmp_path):
    run_dir = tmp_path / "run"
    functrain.fit(_digits_config(run_dir, "train.max_steps=6"), model=build_module(DigitsCNN, seed=0))
    before = _files(run_dir)

    class Flat(nn.Module):  # one number per example: no classifier logits
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 1)

        def forward(self, x):
            return self.linear(x)[:, 0]
    with pytest.raises(ConfigError, match=r"Flat returned logits of shape \(2,\); the built-in classifier loss "
                                          r"needs \[2, classes\].*pass loss_fn="):
        functrain.fit(_digits_config(run_dir), model=Flat())
    with pytest.raises(ConfigError, match="model= is a str; backend: torch takes a torch.nn.Module"):
        functrain.fit(_digits_config(run_dir), model="DigitsCNN")
    # Resuming with another module: the parameter that differs is named.
    with pytest.raises(CheckpointError, match=r"params/conv/weight: checkpoint float32\[8,1,3,3\] vs model "
                                              r"float32\[4,1,3,3\]"):
        functrain.fit(_digits_config(run_dir, "train.max_steps=12"), model=DigitsCNN(channels=4))

    class Renamed(DigitsCNN):
        def __init__(self):
            super().__init__()
            self.classifier = self.head
            del self.head

        def forward(self, x):
            return self.classifier(F.max_pool2d(F.relu(self.norm(self.conv(x.view(-1, 1, 8, 8)))), 2).flatten(1))
    with pytest.raises(CheckpointError, match="params/classifier/weight"):
        functrain.fit(_digits_config(run_dir, "train.max_steps=12"), model=Renamed())
    assert _files(run_dir) == before


def test_accumulation_4x8_equals_32_with_a_user_loss(tmp_path):
    def weighted_cross_entropy(model, batch, generator):
        losses = F.cross_entropy(model(batch["x"]), batch["y"].long(), reduction="none")
        return (losses * batch["weight"]).sum(), batch["weight"].sum(), {}

    rng = np.random.default_rng(0)
    batch = {"x": rng.random((32, 64), dtype=np.float32), "y": rng.integers(0, 10, 32).astype(np.int32),
             "weight": rng.random(32).astype(np.float32)}  # unequal weights: a mean of means would differ
    params = {}
    for micro in (1, 4):
        config = _digits_config(tmp_path, f"train.micro_batches={micro}", "data.global_batch_size=32")
        model = build_module(lambda: nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)), seed=0)
        backend = make_backend(config, batch, 12, model=model, loss_fn=weighted_cross_entropy)
        state, _ = backend.train_call(backend.init_state(), {k: np.stack([v] * 2) for k, v in batch.items()})
        params[micro] = state.params
    assert all(torch.allclose(params[1][k], params[4][k], atol=1e-6) for k in params[1])


def test_torch_compile_step_equals_the_eager_step(tmp_path):
    """train.torch_compile: same dropout masks, same updates within float rounding, bitwise run to run."""
    rng = np.random.default_rng(0)
    batch = {"x": rng.random((16, 64), dtype=np.float32), "y": rng.integers(0, 10, 16).astype(np.int32),
             "weight": np.ones(16, np.float32)}
    batches = {k: np.stack([v] * 3) for k, v in batch.items()}
    runs = []
    for compile_ in (False, True, True):
        config = _digits_config(tmp_path, f"train.torch_compile={str(compile_).lower()}",
                                "data.global_batch_size=16")
        model = build_module(lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5),
                                                   nn.Linear(32, 10)), seed=0)
        backend = make_backend(config, batch, 12, model=model)
        state, metrics = backend.train_call(backend.init_state(), batches)
        runs.append((state.params, metrics["loss"]))
    (eager, eager_loss), (first, first_loss), (second, second_loss) = runs
    assert torch.allclose(eager_loss, first_loss, rtol=1e-5)  # a different mask would move the loss by far more
    assert all(torch.allclose(eager[k], first[k], atol=1e-5) for k in eager)
    assert torch.equal(first_loss, second_loss) and all(torch.equal(first[k], second[k]) for k in first)


def test_torch_compile_is_refused_where_it_does_not_apply(tmp_path):
    with pytest.raises(ConfigError, match="train.torch_compile=true is for backend: torch"):
        load_config(REPO / "configs" / "mlp_digits.yaml", [f"run.dir={tmp_path}", "train.torch_compile=true"])
    config = _digits_config(tmp_path, "train.torch_compile=true")
    with pytest.raises(ConfigError, match="built-in mlp twin runs eagerly"):
        make_backend(config, {"x": np.zeros((4, 64), np.float32), "y": np.zeros(4, np.int32),
                              "weight": np.ones(4, np.float32)}, 12)
