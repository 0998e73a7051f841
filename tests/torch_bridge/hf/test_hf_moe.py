"""Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints: transformers' fused in-memory expert names read as its per-expert
files are, a missing or extra expert named, the exported config free of functrain's MoE options. Their logits both
ways and bit-exact round trips: the registry's conversion module, test_hf_families.py (with these models)."""

import json
import re

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file

from functrain.errors import CheckpointError
from tests.torch_bridge.hf.test_hf_convert import LLAMA_CONFIG, hf_logits, hf_tensors
from torch_bridge.hf import hf_to_run_dir, read_params, save_pretrained

MOE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24)
QWEN = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, num_hidden_layers=3)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(MOE, sliding_window=5)),
    # A dense middle layer (mlp_only_layers), the shared expert and its gate, q/k/v biases, top-k unnormalised.
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, dict(
        QWEN, mlp_only_layers=[1], shared_expert_intermediate_size=20, norm_topk_prob=False)),
    # Every other layer sparse (decoder_sparse_step), QK-norm, an explicit head_dim, top-k renormalised.
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        QWEN, decoder_sparse_step=2, head_dim=12, norm_topk_prob=True)),
}


def build_moe_model(family: str) -> transformers.PreTrainedModel:
    """A tiny random transformers MoE; weights perturbed so the router's choices are not near ties."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**LLAMA_CONFIG, **extra}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, transformers model, its reference logits, its save_pretrained directory)."""
    model = build_moe_model(request.param)
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    model.save_pretrained(directory)
    return request.param, model, hf_logits(model), directory


def test_fused_in_memory_names_read_too(tmp_path, saved):
    """transformers' in-memory state dict (experts fused per projection) read as the per-expert files are."""
    family, model, _, directory = saved
    (tmp_path / "fused").mkdir()
    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    save_file(state, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_text((directory / "config.json").read_text())
    fused, _ = read_params(tmp_path / "fused")
    per_expert, _ = read_params(directory)
    jax.tree.map(np.testing.assert_array_equal, fused, per_expert)


@pytest.mark.parametrize("change", ["drop", "extra"])
def test_missing_or_extra_expert_is_named(tmp_path, saved, change):
    _, _, _, directory = saved
    tensors = hf_tensors(directory)
    last = sorted(name for name in tensors if ".experts.3." in name)[-1]  # e.g. layers.2...experts.3.up_proj
    layer = re.search(r"layers\.(\d+)\.", last).group(1)
    if change == "drop":
        del tensors[last]
        named = f"missing {last} (layer {layer}, expert 3)"
    else:
        named = last.replace(".experts.3.", ".experts.4.")
        tensors[named] = tensors[last]
        named = f"unexpected {named} (layer {layer}, expert 4)"
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "hf" / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(CheckpointError, match=re.escape(named)) as caught:
        hf_to_run_dir(str(tmp_path / "hf"), str(tmp_path / "run"))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "run").exists()


def test_exported_config_round_trips(tmp_path, saved):
    family, _, _, directory = saved
    params, config = read_params(directory)
    save_pretrained(params, config, tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not {"load_balance_scope", "capacity_factor", "router_z_loss_coef", "moe_dispatch"} & set(exported)
    from torch_bridge.hf.pretrained import architecture_for

    module = architecture_for(exported).model
    assert module.to_hf_config(module.from_hf_config(exported)) == module.to_hf_config(config)
