"""DeepSeek-V3's multi-token prediction (functrain.models.mtp): the forward equals a torch implementation of the
report's equations built on transformers' own decoder layer; conversion keeps the layers both ways (tensors equal);
a target never crosses a packed document's boundary; the loss is exact over micro-batches; the layers stay frozen
when their loss weight is 0. The killed-run resume with it on is the bias-update kill test of test_deepseek_v3.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax.traverse_util import flatten_dict
from safetensors.torch import load_file, save_file

from functrain.core.model_output import CombinedTerms
from functrain.core.program import as_program
from functrain.core.state import TrainState
from functrain.core.step import make_train_step
from functrain.errors import CheckpointError
from functrain.models import build_model, model_config_class
from functrain.models.mtp import trained_positions
from tests.torch_bridge.hf.test_hf_convert import highest_precision  # noqa: F401 (a fixture)
from tests.torch_bridge.hf.test_hf_deepseek_v3 import TINY, VOCAB, build_deepseek
from torch_bridge.hf import read_params, save_pretrained
from torch_bridge.hf.reader import find_weights, stream

MAIN, DEPTH = 2, 2  # main layers (one dense, one MoE), multi-token-prediction modules
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 11))


def _mtp_tensors(tensors: dict, layer: int) -> dict:
    """The released layout's own tensors of the multi-token-prediction layer ``layer``, and its copies of the
    embedding and head."""
    generator = torch.Generator().manual_seed(layer)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    own = {f"model.layers.{layer}.{norm}.weight": 1 + 0.1 * torch.randn(hidden, generator=generator)
           for norm in ("enorm", "hnorm", "shared_head.norm")}  # fmt: skip
    own[f"model.layers.{layer}.eh_proj.weight"] = 0.2 * torch.randn(hidden, 2 * hidden, generator=generator)
    own[f"model.layers.{layer}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])  # a tied model saves no lm_head
    own[f"model.layers.{layer}.shared_head.head.weight"] = head.clone()
    return own


def with_mtp_layers(full: transformers.PreTrainedModel, directory, main: int) -> tuple:
    """``full`` (``main`` layers and the multi-token-prediction layers' decoder layers after them) saved in
    ``directory`` as a checkpoint of ``main`` layers with those modules, as released; returns ``full`` in float64
    (the reference, free of torch's own float32 kernel choices) and the saved tensors in float64."""
    full.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    for layer in range(main, full.config.num_hidden_layers):
        tensors.update(_mtp_tensors(tensors, layer))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config.update(num_hidden_layers=main, num_nextn_predict_layers=full.config.num_hidden_layers - main)
    (directory / "config.json").write_text(json.dumps(config))
    full = full.double()
    full.set_experts_implementation("eager")
    return full, {name: tensor.double() for name, tensor in tensors.items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V3 with ``DEPTH`` multi-token-prediction layers as released, the transformers model whose
    layers ``MAIN..`` are their decoder layers, and the tensors."""
    directory = tmp_path_factory.mktemp("mtp")
    return directory, *with_mtp_layers(build_deepseek("q_lora_yarn", num_hidden_layers=MAIN + DEPTH), directory, MAIN)


def reference_mtp_logits(full: transformers.PreTrainedModel, tensors: dict, ids: np.ndarray, main: int) -> list:
    """Each depth's logits by the report's equations (section 2.2), in torch: h^0 the main model's normed output,
    h^k = Block_k(eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])), logits^k = Head(shared_head_norm(h^k)), with
    ``full``'s layers from ``main`` on as the blocks."""
    tokens = torch.tensor(ids)
    length = tokens.shape[1]
    positions = torch.arange(length)[None]
    causal = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)[None, None]

    def rms(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + full.config.rms_norm_eps)

    with torch.no_grad():
        model = full.model
        hidden = model.embed_tokens(tokens)
        rotary = model.rotary_emb(hidden, positions)
        for layer in model.layers[:main]:
            hidden = layer(hidden, attention_mask=causal, position_ids=positions, position_embeddings=rotary)
        hidden = model.norm(hidden)
        logits = []
        for k in range(1, full.config.num_hidden_layers - main + 1):
            name = f"model.layers.{main + k - 1}"
            ahead = torch.cat([tokens[:, k:], torch.zeros_like(tokens[:, :k])], dim=1)  # t_{i+k}
            joined = torch.cat([rms(model.embed_tokens(ahead), tensors[f"{name}.enorm.weight"]),
                                rms(hidden, tensors[f"{name}.hnorm.weight"])], dim=-1)  # fmt: skip
            projected = joined @ tensors[f"{name}.eh_proj.weight"].T
            block = model.layers[main + k - 1]
            hidden = block(projected, attention_mask=causal, position_ids=positions, position_embeddings=rotary)
            logits.append(full.lm_head(rms(hidden, tensors[f"{name}.shared_head.norm.weight"])).numpy())
    return logits


def _mtp_logits(params, config, ids):
    """functrain's per-depth logits: each module's normed output (captured) through the shared head."""
    model = build_model(config)
    forward = jax.jit(lambda p, x: model.apply({"params": p}, x, capture_intermediates=True, mutable=["intermediates"]))
    captured = forward(params, jnp.asarray(ids))[1]["intermediates"]
    head = params["embed_tokens"]["embedding"].T if config.tie_word_embeddings else params["lm_head"]["kernel"]
    return [np.asarray(captured[f"mtp_layers_{depth}"]["shared_head_norm"]["__call__"][0] @ head)
            for depth in range(config.num_nextn_predict_layers)]  # fmt: skip


def check_against_the_reference(directory, full, tensors, main: int) -> tuple:
    """functrain's per-depth logits of the converted ``directory`` equal :func:`reference_mtp_logits`; returns the
    params and config."""
    params, config = read_params(directory)
    got = _mtp_logits(params, config, IDS)
    want = reference_mtp_logits(full, tensors, IDS, main)
    assert len(got) == len(want) == config.num_nextn_predict_layers
    for depth, (ours, theirs) in enumerate(zip(got, want), start=1):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0, err_msg=f"depth {depth}")
    return params, config


def test_the_forward_follows_the_report_as_a_torch_implementation_does(checkpoint, highest_precision):
    directory, full, tensors = checkpoint
    _, config = check_against_the_reference(directory, full, tensors, MAIN)
    assert config.num_nextn_predict_layers == DEPTH


def assert_round_trip(params, config, directory, out) -> None:
    """``params`` exported to ``out``: the same tensors as ``directory``'s, bit for bit, and the same depth."""
    exported = save_pretrained(params, config, out)
    depth = json.loads((directory / "config.json").read_text())["num_nextn_predict_layers"]
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == depth
    # transformers saves the MLP of no shared experts 0 wide: nothing to convert, nothing exported.
    original = {name: tensor for name, tensor in load_file(directory / "model.safetensors").items() if tensor.numel()}
    again = dict(stream(find_weights(exported)))
    assert set(again) == set(original)
    for name, tensor in original.items():
        np.testing.assert_array_equal(again[name], tensor.numpy(), err_msg=name)


def test_conversion_keeps_the_layers_both_ways(checkpoint, tmp_path):
    directory, _, _ = checkpoint
    params, config = read_params(directory)
    assert {"mtp_layers_0", "mtp_layers_1"} <= set(params)
    assert_round_trip(params, config, directory, tmp_path / "out")


def test_copies_of_the_shared_embedding_that_differ_are_refused(checkpoint, tmp_path):
    directory, _, _ = checkpoint
    tensors = load_file(directory / "model.safetensors")
    tensors[f"model.layers.{MAIN}.shared_head.head.weight"] += 1.0
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(CheckpointError, match=rf"model\.layers\.{MAIN}\.shared_head\.head\.weight differs from "
                                               r"lm_head\.weight.*one weight \(lm_head/kernel\)") as raised:
        read_params(tmp_path)
    assert "\n" not in str(raised.value)


def test_a_partial_layer_is_named_and_a_layer_transformers_did_not_save_is_not_asked_for(checkpoint, tmp_path):
    directory, _, _ = checkpoint
    tensors = load_file(directory / "model.safetensors")
    del tensors[f"model.layers.{MAIN + 1}.eh_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(CheckpointError, match=rf"missing model\.layers\.{MAIN + 1}\.eh_proj\.weight"):
        read_params(tmp_path)
    main_only = {name: tensor for name, tensor in tensors.items() if not name.startswith(f"model.layers.{MAIN}")
                 and not name.startswith(f"model.layers.{MAIN + 1}")}  # fmt: skip
    save_file(main_only, tmp_path / "model.safetensors")  # as transformers saves it, config.json still saying 2
    params, config = read_params(tmp_path)
    assert config.num_nextn_predict_layers == 0 and not any(name.startswith("mtp") for name in params)


# ------------------------------------------------------------------------------------------------- training

# One layer and one multi-token-prediction module, both dense (cheap to compile; the MoE ones are checked above).
TRAINED = dict(TINY, name="deepseek_v3", num_hidden_layers=1, first_k_dense_replace=2, num_nextn_predict_layers=1,
               mtp_loss_weight=0.3, initializer_range=0.2)


def test_a_target_never_crosses_a_packed_documents_boundary():
    segments = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 0]])
    mask = jnp.asarray([[1, 1, 1, 1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(trained_positions(segments, mask, 2, (1, 8)), [[1, 1, 0, 0, 1, 0, 0, 0]])
    # The model's terms on two packed documents are the sums of its terms on each alone (padded to the same length).
    model = build_model(model_config_class("deepseek_v3").model_validate(TRAINED))
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.asarray(IDS))["params"]

    @jax.jit
    def terms(ids, segment_ids, positions, token_mask):
        output = model.apply({"params": params}, ids[None], segment_ids=segment_ids[None],
                             positions=positions[None], token_mask=token_mask[None])  # fmt: skip
        return output.terms.parts[1].loss_sums, output.terms.parts[1].counts

    length, first = IDS.shape[1], 6
    documents = (IDS[0, :first], IDS[1, : length - first])
    packed = terms(np.concatenate(documents), np.repeat([1, 2], [first, length - first]),
                   np.concatenate([np.arange(first), np.arange(length - first)]), np.ones(length))  # fmt: skip
    alone = [terms(np.pad(document, (0, length - len(document))), np.ones(length, int), np.arange(length),
                   np.arange(length) < len(document)) for document in documents]  # fmt: skip
    np.testing.assert_array_equal(packed[1], [first - 2 + length - first - 2])  # t_{i+2} in i's own document
    np.testing.assert_array_equal(packed[1], alone[0][1] + alone[1][1])
    np.testing.assert_allclose(packed[0], alone[0][0] + alone[1][0], rtol=1e-5)


def _one_step(micro_batches: int):
    """One plain SGD step at rate 1 (the update is the gradient: Adam's normalisation would magnify rounding on the
    smallest gradients) of a DeepSeek-V3 with multi-token prediction: the state and metrics."""
    config = model_config_class("deepseek_v3").model_validate(TRAINED)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (8, 9))
    batch = {"tokens": tokens, "weight": np.ones(len(tokens), np.float32)}
    program = as_program(build_model(config), batch)
    params, model_state = jax.jit(program.init)(jax.random.PRNGKey(0))
    step = jax.jit(make_train_step(program.loss_fn, optax.sgd(1.0), micro_batches=micro_batches, stateful=True,
                                   batch_totals=program.batch_totals))  # fmt: skip
    return step(TrainState.create(params, optax.sgd(1.0), jax.random.PRNGKey(1), model_state), batch)


def test_the_loss_is_exact_over_micro_batches():
    whole, whole_metrics = _one_step(1)
    split, split_metrics = _one_step(4)
    for name in ("loss", "mtp/loss_d1"):
        np.testing.assert_allclose(split_metrics[name], whole_metrics[name], rtol=1e-6, err_msg=name)
    assert 3.5 < whole_metrics["mtp/loss_d1"] < 5.0  # about log(64): a mean per trained position, not a sum
    for path, leaf in flatten_dict(whole.params).items():
        np.testing.assert_allclose(flatten_dict(split.params)[path], leaf, atol=1e-6, err_msg="/".join(path))


def test_without_a_loss_weight_the_layers_are_kept_frozen_and_not_run():
    model = build_model(model_config_class("deepseek_v3").model_validate({**TRAINED, "mtp_loss_weight": 0.0}))
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.asarray(IDS))["params"]
    assert "mtp_layers_0" in params
    trainable = flatten_dict(model.trainable_mask(params))
    assert {path[0] for path, kept in trainable.items() if not kept} == {"mtp_layers_0"}
    output = jax.eval_shape(lambda p: model.apply({"params": p}, jnp.asarray(IDS)), params)
    assert not isinstance(output.terms, CombinedTerms)  # the MoE's terms alone: no multi-token prediction
