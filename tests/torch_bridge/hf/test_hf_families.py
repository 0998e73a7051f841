"""Conversion, checked for every family the registry converts: each HF ``model_type`` a family declares has cases
here (a family registered without one fails the suite), each a tiny random transformers model with its features
on. Every case: logits within 1e-5 of transformers' (float32) both ways (HF directory -> functrain, functrain ->
HF directory that transformers loads); every model type: a bf16 sharded safetensors directory round-trips bit for
bit through functrain and its config through transformers. Family-specific checks (file layouts, FP8, MXFP4, fused
experts, errors) live in the family's own module beside this one.

Each case's window, head size or RoPE scaling actually changes the logits for the 12-token test input (window
4-5, ``max_position_embeddings`` 8 for ``dynamic``).
"""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from functrain.errors import ConfigError
from tests.torch_bridge.hf import test_hf_gpt_oss, test_hf_moe, test_hf_qwen3_next
from tests.torch_bridge.hf.test_hf_convert import GPT2_CONFIG, IDS, LLAMA_CONFIG, VOCAB, hf_logits, hf_tensors, write_layout
from tests.torch_bridge.hf.test_hf_deepseek_v3 import CASES as DEEPSEEK_CASES, TINY as DEEPSEEK
from torch_bridge.hf import hf_to_run_dir, load_pretrained, read_params, save_pretrained
from torch_bridge.hf.architectures import architecture_for, architectures

# HF model_type -> (transformers config class, model class, the tiny config its cases change).
FAMILIES = {
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel, GPT2_CONFIG),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, LLAMA_CONFIG),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, LLAMA_CONFIG),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, LLAMA_CONFIG),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, LLAMA_CONFIG),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, LLAMA_CONFIG),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, LLAMA_CONFIG),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, LLAMA_CONFIG),
    **{family: (config, model, {**LLAMA_CONFIG, **extra}) for family, (config, model, extra)
       in test_hf_moe.FAMILIES.items()},
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, DEEPSEEK),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, test_hf_gpt_oss.CONFIG),
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, LLAMA_CONFIG),
    "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM, LLAMA_CONFIG),
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM, dict(
        LLAMA_CONFIG, num_hidden_layers=3, head_dim=12, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=2)),
    "llama4_text": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM, dict(
        LLAMA_CONFIG, num_hidden_layers=4, head_dim=12, intermediate_size=16, intermediate_size_mlp=40,
        num_local_experts=4)),
    "gemma4_text": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM, dict(
        LLAMA_CONFIG, num_hidden_layers=4, head_dim=8, global_head_dim=16, sliding_window=4, vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8, max_position_embeddings=64)),
    # The Gated DeltaNet hybrids: their own module's tiny configs (every feature on; more cases there).
    **{family: (config, model, {**test_hf_qwen3_next.HYBRID, **test_hf_qwen3_next.CASES[family]})
       for family, (config, model) in test_hf_qwen3_next.FAMILIES.items()},
}
# case -> (model_type, what it changes in the family's tiny config); a model type's first case is its round trip's.
CASES = {
    "gpt2": ("gpt2", {}),
    "llama_dynamic": ("llama", dict(max_position_embeddings=8, rope_scaling=dict(rope_type="dynamic", factor=2.0))),
    "qwen2_sliding_upper_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen2_yarn_tied": ("qwen2", dict(tie_word_embeddings=True, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=16.0))),
    "qwen3_bias_headdim": ("qwen3", dict(head_dim=16, attention_bias=True)),
    "qwen3_sliding_linear": ("qwen3", dict(head_dim=8, use_sliding_window=True, sliding_window=5, max_window_layers=0,
                                           rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral_window_headdim": ("mistral", dict(sliding_window=5, head_dim=12)),
    "phi3_longrope": ("phi3", dict(max_position_embeddings=32, original_max_position_embeddings=8, rope_scaling=dict(
        rope_type="longrope", short_factor=[1.0, 1.1, 1.2, 1.3], long_factor=[1.5, 2.0, 3.0, 4.0]))),
    "phi3_fused_window": ("phi3", dict(sliding_window=5)),
    # Caps small enough to bend the tiny model's scores and logits; global layer first to test layer_types.
    "gemma2_softcap_alternating": ("gemma2", dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=12,
                                                  attn_logit_softcapping=0.5, final_logit_softcapping=2.0,
                                                  layer_types=["full_attention", "sliding_attention"])),
    "gemma3_qk_norm_local_rope": ("gemma3_text", dict(
        head_dim=8, sliding_window=4, query_pre_attn_scalar=12, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    # test_hf_moe.FAMILIES: windows, a dense middle layer, a gated shared expert, QK-norm, sparse steps.
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    # Latent attention with and without q_lora_rank, YaRN's mscale, group-limited routing, the dense first layer.
    **{f"deepseek_v3_{case}": ("deepseek_v3", extra) for case, extra in DEEPSEEK_CASES.items()},
    "gpt_oss": ("gpt_oss", {}),  # sinks, windows, YaRN, biased router and experts, the clamped SwiGLU
    # NoPE layers (a longer list than the layers, as HF allows), windows on two of them, biases, YaRN.
    "smollm3_nope_windows_biases_yarn": ("smollm3", dict(
        num_hidden_layers=4, head_dim=12, attention_bias=True, mlp_bias=True, no_rope_layers=[1, 0, 1, 0, 1],
        use_sliding_window=True, sliding_window=4, tie_word_embeddings=False,
        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=8))),
    # transformers' derived pattern: every second layer NoPE and sliding; tied, linear rope.
    "smollm3_derived_pattern_tied": ("smollm3", dict(
        num_hidden_layers=4, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=5,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0))),
    # Norms after the sublayers, q/k norms over all heads, a rope per layer type (YaRN full, linear sliding).
    "olmo3_rope_by_layer_type_biases": ("olmo3", dict(
        num_hidden_layers=4, head_dim=12, attention_bias=True, sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                                original_max_position_embeddings=8),
                         "sliding_attention": dict(rope_type="linear", rope_theta=100.0, factor=2.0)})),
    "olmo3_default_layer_types_tied": ("olmo3", dict(num_hidden_layers=4, sliding_window=3, tie_word_embeddings=True)),
    # A dense first layer, groups, q/k norms, half of each head rotated by YaRN, q/k/v biases, scaled weights, two
    # shared experts' width.
    "glm4_moe_groups_qk_norm_partial_yarn": ("glm4_moe", dict(
        attention_bias=True, use_qk_norm=True, n_group=2, topk_group=1, routed_scaling_factor=1.5, n_shared_experts=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=8,
                             partial_rotary_factor=0.5))),
    # Every layer sparse, no shared expert (transformers saves its MLP 0 wide), a quarter of each head rotated,
    # weights not renormalised, tied.
    "glm4_moe_all_sparse_tied": ("glm4_moe", dict(
        head_dim=16, first_k_dense_replace=0, n_shared_experts=0, norm_topk_prob=False,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                       partial_rotary_factor=0.25))),
    **{family: (family, {}) for family in test_hf_qwen3_next.FAMILIES},
    # Chunks of 3 on the RoPE layers (Meta's adjacent pairs, llama3-scaled, QK norms), NoPE layers between them whose
    # queries warm up every 4 positions, experts on every second layer (top 1 with the shared expert), biases.
    "llama4_chunks_nope_temperature_experts": ("llama4_text", dict(
        no_rope_layer_interval=2, attention_chunk_size=3, floor_scale=4, attn_scale=0.5, interleave_moe_layer_step=2,
        attention_bias=True, rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=8))),
    # Two experts a token on the layers moe_layers names, a NoPE layer chunked as layer_types says, no QK norm, tied.
    "llama4_top2_listed_layers_tied": ("llama4_text", dict(
        num_experts_per_tok=2, moe_layers=[0, 3], no_rope_layers=[1, 1, 0, 1], attention_chunk_size=5,
        layer_types=["chunked_attention", "full_attention", "chunked_attention", "full_attention"], use_qk_norm=False,
        floor_scale=2, tie_word_embeddings=True)),
    # Windows of 4; global layers with their own head width, one key/value head that is the values too and
    # proportional rope (half turning, scaled); per-layer inputs; experts beside every MLP; biases; an untied,
    # soft-capped head; layer scalars off 1.
    "gemma4_every_feature": ("gemma4_text", dict(
        attention_k_eq_v=True, num_global_key_value_heads=1, attention_bias=True, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=16, final_logit_softcapping=2.0, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                         "full_attention": dict(rope_type="proportional", rope_theta=1e4, partial_rotary_factor=0.5,
                                                factor=2.0)})),
    # The last 2 layers reuse the keys and values of the last earlier layer of their type (layer 1's sliding ones,
    # layer 2's global ones, whose keys are the values), their MLPs twice as wide; per-layer inputs, experts.
    "gemma4_shared_kv_double_wide_mlp": ("gemma4_text", dict(
        num_hidden_layers=5, num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True,
        num_global_key_value_heads=1, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
    # transformers' derived layers (a global first layer, the last forced global) with scaled ropes of other types,
    # separate values, no per-layer inputs, tied.
    "gemma4_derived_layers_scaled_ropes_tied": ("gemma4_text", dict(
        hidden_size_per_layer_input=0, layer_types=["full_attention"] + ["sliding_attention"] * 3,
        rope_parameters={"sliding_attention": dict(rope_type="linear", rope_theta=100.0, factor=2.0),
                         "full_attention": dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                                original_max_position_embeddings=8)})),
}
# The case each model type's round trip (and its first layout) uses.
ROUND_TRIP = {model_type: next(case for case, (of, _) in CASES.items() if of == model_type) for model_type in FAMILIES}


# The hybrids' weights perturbed by less: at 0.1 transformers' own float32 logits stray 1e-5 from its float64 ones
# (test_hf_qwen3_next.build_hybrid).
PERTURBATION = {family: 0.05 for family in test_hf_qwen3_next.FAMILIES} | {"gemma4_text": 0.05}  # Gemma 4's too


def build_family_model(case: str, dtype=torch.float32, **change) -> transformers.PreTrainedModel:
    """A tiny random model of ``case``'s family (with ``change`` to its config); weights perturbed so biases and
    norms are not 0/1, and DeepSeek's correction biases enough to change which experts are chosen."""
    family, extra = CASES[case]
    config_cls, model_cls, base = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**base, **extra, **change}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(PERTURBATION.get(family, 0.1) * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "layer_scalar")):  # DeepSeek's, Gemma 4's
                buffer.add_(0.3 * torch.randn_like(buffer))
    return model.to(dtype).eval()


def ids_for(model: transformers.PreTrainedModel) -> np.ndarray:
    """The test input within the model's vocabulary."""
    return IDS % model.config.vocab_size


def test_every_model_type_the_registry_converts_has_a_case_here():
    cased = {model_type for model_type, _ in CASES.values()}
    missing = sorted(set(architectures()) - cased)
    assert not missing, f"no conversion case for model_type {', '.join(missing)}: add one to CASES"
    assert cased <= set(architectures()) and set(FAMILIES) == cased


@pytest.fixture(scope="module")
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


# Every file layout on some case (the others: sharded safetensors, as transformers writes big checkpoints).
LAYOUTS = {"qwen2_yarn_tied": "bin", "qwen3_bias_headdim": "bin_sharded", "qwen3_sliding_linear": "safetensors",
           "mistral_window_headdim": "safetensors", "llama_dynamic": "safetensors", "phi3_fused_window": "bin_sharded",
           "phi3_longrope": "safetensors", "gemma3_qk_norm_local_rope": "bin"}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_both_ways(tmp_path, highest_precision, case):
    model = build_family_model(case)
    ids = ids_for(model)
    reference = hf_logits(model, ids)
    write_layout(model, tmp_path / "in", LAYOUTS.get(case, "safetensors_sharded"))
    apply_fn, params, config = load_pretrained(tmp_path / "in")
    assert config.registry_name() == architecture_for(model.config.to_dict()).family
    np.testing.assert_allclose(np.asarray(apply_fn(params, ids)), reference, atol=1e-5, rtol=0)

    out = save_pretrained(params, config, tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported) is type(model)
    np.testing.assert_allclose(hf_logits(exported, ids), reference, atol=1e-5, rtol=0)


def test_windows_follow_the_hf_layer_types():
    _, _, qwen2 = load_config_only("qwen2_sliding_upper_layers")
    assert [qwen2.attention_window(i) for i in range(2)] == [None, 4]
    _, _, mistral = load_config_only("mistral_window_headdim")
    assert [mistral.attention_window(i) for i in range(2)] == [5, 5]
    _, _, gemma = load_config_only("gemma2_softcap_alternating")
    assert [gemma.attention_window(i) for i in range(2)] == [None, 4]


def load_config_only(case: str):
    hf = build_family_model(case).config.to_dict()
    arch = architecture_for(hf)
    return hf, arch, arch.model.from_hf_config(hf)


@pytest.mark.parametrize("model_type", sorted(architectures()))
def test_bf16_sharded_round_trip_is_bit_exact_and_transformers_reads_the_config(tmp_path, model_type):
    case = ROUND_TRIP[model_type]  # a KeyError: a registered model type without a case (see CASES)
    model = build_family_model(case, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "in", max_shard_size=8000)
    assert (tmp_path / "in" / "model.safetensors.index.json").exists()
    params, config = read_params(tmp_path / "in")
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}
    save_pretrained(params, config, tmp_path / "out", max_shard_size="6KB")
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    original, exported = hf_tensors(tmp_path / "in"), hf_tensors(tmp_path / "out")
    assert sorted(original) == sorted(exported)  # transformers' own names (per-expert ones on MoE models)
    for name, tensor in original.items():
        assert np.array_equal(exported[name].view(np.int16), tensor.view(np.int16)), name
    _, arch, _ = load_config_only(case)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == model_type and written["dtype"] == "bfloat16"
    again = arch.model.from_hf_config(written)
    # ``config``: config.json's as the weights complete it (no multi-token-prediction depth where transformers saved
    # none of those layers); head_dim is written explicitly.
    assert arch.model.to_hf_config(again) == arch.model.to_hf_config(config)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert type(theirs) is type(model.config) and arch.model.from_hf_config(theirs.to_dict()) == again


@pytest.mark.parametrize("family, change, named", [
    ("qwen2", dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4, factor=2.0)), "longrope"),
    ("mistral", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0,
                                          original_max_position_embeddings=8, extrapolation_mode="x")),
     "extrapolation_mode"),
    ("qwen3", dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0, beta_fast=3.0)), "beta_fast"),
    ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "sliding layers support only the default rope"),
    ("phi3", dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0], long_factor=[1.0],
                                       original_max_position_embeddings=8)), "short_factor has 1 entries"),
    ("smollm3", dict(attention_dropout=0.1), r"attention_dropout 0.1 is not supported for smollm3 \(functrain's "
                                             r"model has no attention dropout\); set attention_dropout to 0.0"),
    ("smollm3", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4),
     "layer_types has sliding_attention layers but use_sliding_window is false or sliding_window unset"),
    ("olmo3", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4)), "olmo3's rope_parameters are nested "
                                                                               "by layer type"),
    ("olmo3", dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e4,
                                                           partial_rotary_factor=0.5)}), "partial_rotary_factor"),
    ("glm4_moe", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25)),
     r"head_dim 12 x partial_rotary_factor 0.25 gives 3 rotated features"),
    ("glm4_moe", dict(attention_dropout=0.5), "attention_dropout 0.5 is not supported for glm4_moe"),
    ("llama4_text", dict(attention_dropout=0.1), "attention_dropout 0.1 is not supported for llama4_text"),
    ("llama4_text", dict(attention_chunk_size=None), "chunked_attention layers but attention_chunk_size is unset"),
    ("gemma4_text", dict(num_kv_shared_layers=1), "num_kv_shared_layers 1 leaves no earlier full_attention layer to "
                                                  "compute layer 3's keys and values; lower num_kv_shared_layers"),
    ("gemma4_text", dict(use_bidirectional_attention="all"), "use_bidirectional_attention 'all' is not supported"),
    ("gemma4_text", dict(per_layer_config={"1": {"intermediate_size": 8}}),
     r"per_layer_config\['1'\] sets intermediate_size, which functrain does not vary by layer"),
    ("gemma4_text", dict(rope_parameters={"full_attention": dict(rope_type="proportional", rope_theta=1e4,
                                                                 beta_fast=2.0)}), "proportional rope does not implement beta_fast"),
])
def test_unimplemented_config_features_are_named(tmp_path, family, change, named):
    config_cls, model_cls, base = FAMILIES[family]
    model_cls(config_cls(**base)).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    before = {path.name: path.read_bytes() for path in (tmp_path / "hf").iterdir()}
    with pytest.raises(ConfigError, match=named) as caught:
        hf_to_run_dir(str(tmp_path / "hf"), str(tmp_path / "run"))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "run").exists()
    assert {path.name: path.read_bytes() for path in (tmp_path / "hf").iterdir()} == before
