"""Typed model configs: every family answers what the rest of functrain asks of a model (context, vocabulary,
classes, decoder shape, scanned layers) as the getattr guesses it replaces did; the ``model`` section is a union
discriminated by ``name`` whose errors name the key (and the nearest valid one) for every family; and the config
validates without importing model code."""

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import flax.linen
import pytest
import torch
import transformers

from functrain.config.load import load_config
from functrain.config.model_section import PythonModelConfig, TargetModelConfig
from functrain.errors import ConfigError
from functrain.models import build_model, family_names, model_config_class
from functrain.models.configs.base import DecoderShape
from functrain.models.configs.hf import ACTIVATIONS
from functrain.models.hf_common import FUNCTIONS
from functrain.models.scan import scan_groups
from functrain.plan.planner import advice
from torch_bridge.user_model import decoder_shape as module_shape

# Small configs away from the defaults where the shape has choices: grouped-query heads, an explicit head
# width, GPT-2's n_inner, windows by layer.
LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=48)
# The Gated DeltaNet hybrids' own keys (linear attention) on Llama's sizes.
HYBRID = dict(LLAMA, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, num_hidden_layers=4)
SECTIONS: dict[str, dict[str, Any]] = {
    "mlp": dict(hidden=[8], num_classes=3),
    "gpt": dict(vocab_size=300, max_len=40, d_model=32, n_layers=3, n_heads=4, d_ff=48),
    "gpt2": dict(vocab_size=80, n_positions=24, n_embd=32, n_layer=2, n_head=4, n_inner=72),
    "llama": LLAMA,
    "mistral": dict(LLAMA, sliding_window=8),
    "phi3": dict(LLAMA, sliding_window=8),
    "qwen2": dict(LLAMA, sliding_window=8, layer_types=["full_attention", "sliding_attention"] * 2 + ["full_attention"]),
    "qwen3": dict(LLAMA, head_dim=24),
    "gemma2": dict(LLAMA, head_dim=16, sliding_window=8),
    "gemma3_text": dict(LLAMA, head_dim=16, sliding_window=8, num_hidden_layers=7),
    "gpt_oss": dict(LLAMA, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2),
    "mixtral": dict(LLAMA, sliding_window=8, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=40),
    "qwen3_moe": dict(LLAMA, head_dim=24, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16),
    "deepseek_v3": dict(LLAMA, num_key_value_heads=None, moe_intermediate_size=16, n_routed_experts=8, n_group=4,
                        topk_group=2, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=None),
    "smollm3": dict(LLAMA, no_rope_layers=[1, 1, 0, 1, 0], use_sliding_window=True, sliding_window=8),
    "olmo3": dict(LLAMA, sliding_window=8),
    "glm4_moe": dict(LLAMA, head_dim=24, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                     first_k_dense_replace=2),
    "llama4": dict(LLAMA, head_dim=16, intermediate_size=16, intermediate_size_mlp=40, num_local_experts=4,
                   interleave_moe_layer_step=2, attention_chunk_size=8),
    "gemma4": dict(LLAMA, head_dim=16, global_head_dim=32, sliding_window=8, hidden_size_per_layer_input=8,
                   enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24),
    "qwen3_5_text": HYBRID,
    "qwen3_5_moe_text": dict({key: value for key, value in HYBRID.items() if key != "intermediate_size"},
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),  # experts on every layer
    "qwen3_next": dict(HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
                       layer_types=["linear_attention", "full_attention"] * 2),
}
# A mixture of experts' MLP width and router outputs per token (every layer sparse in these configs but GLM's and
# Llama 4's).
ACTIVE = {
    "mixtral": lambda c: (c.num_experts_per_tok * c.intermediate_size, c.num_local_experts),
    "qwen2_moe": lambda c: (c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size,
                            c.num_experts + 1),
    "qwen3_moe": lambda c: (c.num_experts_per_tok * c.moe_intermediate_size, c.num_experts),
    # Dense first layers: the width and router outputs averaged over the layers.
    "glm4_moe": lambda c: (
        round(((c.num_hidden_layers - c.first_k_dense_replace) * (c.num_experts_per_tok + c.n_shared_experts)
               * c.moe_intermediate_size + c.first_k_dense_replace * c.intermediate_size) / c.num_hidden_layers),
        round((c.num_hidden_layers - c.first_k_dense_replace) * c.n_routed_experts / c.num_hidden_layers)),
    # Experts on every interleave_moe_layer_step-th layer (k routed and the shared one), the dense layers' own width.
    "llama4": lambda c: (
        round(((c.num_hidden_layers // c.interleave_moe_layer_step) * (c.num_experts_per_tok + 1) * c.intermediate_size
               + (c.num_hidden_layers - c.num_hidden_layers // c.interleave_moe_layer_step) * c.intermediate_size_mlp)
              / c.num_hidden_layers),
        round((c.num_hidden_layers // c.interleave_moe_layer_step) * c.num_local_experts / c.num_hidden_layers)),
    # With enable_moe_block the experts run beside the dense MLP on every layer.
    "gemma4": lambda c: (c.intermediate_size + c.experts_per_token() * (c.moe_intermediate_size or 0),
                         c.expert_count()),
}
# Families whose layers differ in head width: the shape's is the layers' mean (Gemma 4's global layers).
MEAN_HEAD_DIM = {"gemma4": lambda c: round(sum(map(c.head_dim_of, range(c.num_hidden_layers))) / c.num_hidden_layers)}


DATA = {"name": "synthetic", "seq_len": 8}  # token ids below any vocabulary


def family(name: str, **changes: Any) -> Any:
    return model_config_class(name).model_validate({"name": name, **SECTIONS[name], **changes})


def error_of(model: Any, **top: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, [], base={"model": model, "data": DATA, **top})
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- what the guesses gave (the previous release)

def guessed_positions(config: Any) -> int | None:
    return next((getattr(config, key) for key in ("max_len", "n_positions", "max_position_embeddings")
                 if getattr(config, key, None) is not None), None)


def guessed_shape(config: Any) -> DecoderShape | None:
    get = lambda *names: next((getattr(config, n) for n in names if getattr(config, n, None)), None)  # noqa: E731
    layers = get("n_layers", "n_layer", "num_hidden_layers")
    width = get("d_model", "n_embd", "hidden_size")
    heads = get("n_heads", "n_head", "num_attention_heads")
    vocab = get("vocab_size")
    if not (layers and width and heads and vocab):
        return None
    return DecoderShape(layers=layers, width=width, heads=heads, kv_heads=get("kv_heads", "num_key_value_heads") or heads,
                        head_dim=get("attn_head_dim", "head_dim") or width // heads,
                        # A mixture of experts: the active width (k experts) and the router's outputs.
                        mlp_width=(get("num_experts_per_tok") or 1) * (get("intermediate_size", "inner_size", "d_ff")
                                                                        or 4 * width),
                        mlp_matrices=3 if getattr(config, "intermediate_size", None) is not None else 2, vocab=vocab,
                        router_width=get("num_local_experts") or 0)


@pytest.mark.parametrize("name", family_names())
@pytest.mark.parametrize("defaults", [True, False], ids=["defaults", "small"])
def test_each_family_answers_as_the_guesses_did(name, defaults):
    config = model_config_class(name)() if defaults else family(name)
    assert config.registry_name() == name
    assert config.max_positions() == guessed_positions(config)
    if name == "deepseek_v3":  # latent attention: test_deepseek_v3_shape_counts_the_models_own_parameters
        return
    if name.startswith("qwen3_5") or name == "qwen3_next":  # hybrids: test_qwen3_next.py counts their layers
        return
    shape = guessed_shape(config)
    if name in ACTIVE:
        width, router = ACTIVE[name](config)
        shape = dataclasses.replace(shape, mlp_width=width, router_width=router)
    if name in MEAN_HEAD_DIM:
        shape = dataclasses.replace(shape, head_dim=MEAN_HEAD_DIM[name](config))
    assert config.decoder_shape() == shape
    assert config.vocabulary_size() == getattr(config, "vocab_size", None)
    assert config.class_count() == getattr(config, "num_classes", None)


def test_the_answers_of_each_kind_of_model():
    assert family("gpt").max_positions() == 40 and family("gpt2").max_positions() == 24
    assert family("llama").max_positions() == 48 and model_config_class("gemma3_text")().max_positions() == 131072
    assert family("mlp").class_count() == 3 and family("mlp").vocabulary_size() is None
    assert family("mlp").decoder_shape() is None and family("mlp").max_positions() is None
    assert family("gpt2").decoder_shape() == DecoderShape(layers=2, width=32, heads=4, kv_heads=4, head_dim=8,
                                                          mlp_width=72, mlp_matrices=2, vocab=80)
    assert family("qwen3").decoder_shape() == DecoderShape(layers=5, width=64, heads=4, kv_heads=2, head_dim=24,
                                                           mlp_width=80, mlp_matrices=3, vocab=96)
    lora = family("llama", lora={"rank": 2}).lora_settings()
    assert lora is not None and lora.rank == 2 and family("llama").lora_settings() is None
    assert family("gpt", remat="full").remat_policy() == "full" and family("mlp").remat_policy() is None


def test_user_models_are_answered_from_their_keywords_or_not_at_all():
    target = TargetModelConfig(target="pkg.models:make", vocab_size=500, num_classes=7, max_len=16, n_layers=2,
                               d_model=8, n_heads=2)
    assert (target.vocabulary_size(), target.class_count()) == (500, 7)
    # The factory's other keywords are its own: no context check, no MFU guessed from them.
    assert target.max_positions() is None and target.decoder_shape() is None and target.registry_name() is None
    assert TargetModelConfig(target="pkg.models:make", vocab_size="big").vocabulary_size() is None
    recorded = PythonModelConfig(python_object="MyModel")
    assert [recorded.max_positions(), recorded.vocabulary_size(), recorded.class_count(), recorded.decoder_shape(),
            recorded.lora_settings(), recorded.remat_policy(), recorded.layer_kinds()] == [None] * 7
    assert not recorded.layers_scanned()


def test_a_transformers_models_shape_is_read_by_the_torch_adapter():
    class Holder(torch.nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.config = config

    gpt2 = transformers.GPT2Config(vocab_size=80, n_positions=24, n_embd=32, n_layer=2, n_head=4)
    llama = transformers.LlamaConfig(**LLAMA)
    # What the guesses read from these configs, and what the same models configured in functrain give.
    assert module_shape(Holder(gpt2)) == guessed_shape(gpt2) == family("gpt2", n_inner=None).decoder_shape()
    assert module_shape(Holder(llama)) == guessed_shape(llama) == family("llama").decoder_shape()
    assert module_shape(torch.nn.Linear(2, 2)) is None
    assert module_shape(Holder(family("gpt"))) is None  # a config of another kind is the user's own business


def test_scanned_layers_are_grouped_by_the_configs_methods():
    qwen2 = family("qwen2", scan_layers=True)  # (full, sliding) x 2, then full: 2 groups of 2 and 1 unrolled
    assert qwen2.layer_kinds() == [None, 8, None, 8, None] and scan_groups(qwen2) == 2
    gemma3 = family("gemma3_text", scan_layers=True)  # 5 local : 1 global, then one local layer
    assert scan_groups(gemma3) == 1 and gemma3.layer_kinds() == [8] * 5 + [None] + [8]
    assert scan_groups(family("gpt")) == 0 and scan_groups(family("gpt2")) == 0
    assert family("gpt2").layer_kinds() is None


def test_plan_advises_remat_only_for_models_that_have_the_option():
    from types import SimpleNamespace
    sizes = {"params": 1, "optimizer": 1, "activations": 100}
    step = SimpleNamespace(micro_batches=1, param_dtype="bfloat16", offload_optimizer=False)
    tips = lambda model: advice(SimpleNamespace(step=step, model_config=model), sizes, 1, {"fsdp": 1})  # noqa: E731
    assert any("model.remat=full (now none)" in tip for tip in tips(family("gpt")))
    assert not any("model.remat" in tip for tip in tips(family("gpt", remat="full")))
    assert not any("model.remat" in tip for tip in tips(TargetModelConfig(target="pkg.models:make")))


# ------------------------------------------------------------------------------------ the union and its errors

@pytest.mark.parametrize("name", family_names())
def test_the_union_picks_each_family_by_name_and_its_code_builds_it(name):
    config = load_config(None, [], base={"model": {"name": name, **SECTIONS[name]}, "data": DATA})
    assert type(config.model) is model_config_class(name) and config.model == family(name)
    assert isinstance(build_model(config.model), flax.linen.Module)  # the declared code module builds this config
    assert load_config(None, [], base=config.to_dict()).model == config.model  # config.yaml reads back


@pytest.mark.parametrize("name", family_names())
def test_a_misspelt_model_key_is_named_with_the_nearest_one_for_every_family(name):
    key = next(iter(SECTIONS[name]))
    message = error_of({"name": name, key[:-1] + "z" + key[-1]: 1})
    assert message == f"unknown config key 'model.{key[:-1]}z{key[-1]}'; did you mean 'model.{key}'?"
    assert error_of({"name": name, key: "many"}).startswith(f"config key 'model.{key}': ")


def test_nested_model_keys_and_the_union_members_without_a_name():
    assert error_of({"name": "llama", "lora": {"rnak": 2}}).endswith("did you mean 'model.lora.rank'?")
    assert error_of({"name": "llama", "rope_scaling": {"rope_type": "linear", "factr": 2.0}}).endswith(
        "did you mean 'model.rope_scaling.factor'?")
    assert error_of({"name": "llama", "lora": {"rank": "two"}}).startswith("config key 'model.lora.rank': ")
    assert error_of({"target": "no_colon"}).startswith("config key 'model.target': 'no_colon' is not an import path")
    assert f"unknown model.name 'lama'; choose one of {', '.join(family_names())}" in error_of({"name": "lama"})
    assert "has both 'name' and 'target'" in error_of({"name": "gpt", "target": "pkg.models:make"})
    assert "needs a 'name'" in error_of({"hidden": [3]}) and "needs a 'name'" in error_of(None)
    assert "not supported by model mlp" in error_of({"name": "mlp", "scan_layers": True})
    assert "longer than the model's context of 40" in error_of({"name": "gpt", "max_len": 40}, data={**DATA, "seq_len": 64})
    assert type(load_config(None, [], base={"model": {"target": "pkg.models:make", "width": 3}}).model) \
        is TargetModelConfig


def test_every_hf_activation_name_computes_a_function():
    assert set(ACTIVATIONS.values()) == set(FUNCTIONS)


def test_the_config_validates_without_importing_model_code():
    script = ("import sys; from functrain.config.load import load_config; "
              "config = load_config('configs/char_gpt.yaml', ['model.n_layers=3']); "
              "assert config.model.decoder_shape().layers == 3; "
              "print(sorted(m for m in sys.modules if m in ('flax', 'functrain.models.gpt', 'torch')))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.strip() == "[]"



def test_deepseek_v3_shape_counts_the_models_own_parameters():
    """Latent attention's projections and the MLP a token uses, as the module's own parameters count them (a small
    config with a dense first layer, a query LoRA and a shared expert); the released config's 37B active."""
    import flax.linen as nn
    import jax
    import numpy as np

    from functrain.models import build_model
    from functrain.models.configs.deepseek_v3 import DeepseekV3Config
    from functrain.report.mfu import train_flops_per_token

    config = family("deepseek_v3", q_lora_rank=12, first_k_dense_replace=1, n_shared_experts=1, num_hidden_layers=3)
    params = nn.meta.unbox(jax.eval_shape(build_model(config).init, jax.random.PRNGKey(0),
                                          np.zeros((1, 4), np.int32))["params"])

    def matrices(tree):  # the matmul parameters: kernels and stacked experts (no norms, no biases)
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(path): leaf.size for path, leaf in leaves if len(leaf.shape) >= 2}

    shape, layers, width = config.decoder_shape(), config.num_hidden_layers, config.hidden_size
    sparse_layer = params["moe_layers_0"]
    assert shape.attention_params == sum(matrices(sparse_layer["self_attn"]).values())
    assert (shape.head_dim, shape.value_head_dim) == (config.qk_head_dim, config.v_head_dim)
    dense = sum(matrices(params["dense_layers_0"]["mlp"]).values())
    router = sparse_layer["mlp"]["gate"]["kernel"].size
    routed = sum(matrices(sparse_layer["mlp"]["experts"]).values())
    shared = sum(matrices(sparse_layer["shared_experts"]).values())
    active = dense + (layers - 1) * (shared + routed * config.num_experts_per_tok // config.n_routed_experts)
    # The shape averages the MLP width and the router over the layers (rounded).
    assert abs(layers * shape.mlp_matrices * width * shape.mlp_width - active) <= layers * 3 * width / 2
    assert abs(layers * width * shape.router_width - (layers - 1) * router) <= layers * width / 2
    released = DeepseekV3Config()
    embedding = released.hidden_size * released.vocab_size
    assert 37e9 < train_flops_per_token(released.decoder_shape(), 0) / 6 + embedding < 38e9
