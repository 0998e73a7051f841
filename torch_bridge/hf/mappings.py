"""Explicit HF ⇄ functrain tensor name tables, one per architecture, each a :class:`TensorMapping` that the
families converting it name in their declaration (``hf_mapping``; :mod:`torch_bridge.hf.architectures` joins them).

Each `Rule` ties one HF tensor to one or more functrain parameter leaves and names the reshaping between
them, so reading and writing are the same table run in two directions:

- ``copy``: same layout (embeddings, norms, biases, GPT-2 ``Conv1D`` weights, which are already (in, out)).
- ``transpose``: a torch ``Linear.weight`` (out, in) is a Flax ``kernel`` (in, out); a stack of them
  (E, out, in), transformers' fused experts, is a stacked kernel (E, in, out).
- ``split3``: GPT-2's fused ``c_attn`` (in, 3·out) / (3·out,) is q, k, v along the last axis.
- ``split_rows``: a fused torch ``Linear.weight`` (Phi-3's ``qkv_proj``, ``gate_up_proj``) is row blocks of
  ``sizes``, each the transpose of one Flax kernel; a stack of them (E, rows, in) likewise per expert.
- ``interleave``: the last axis alternates two leaves, the first at even indices (GPT-OSS's stacked
  ``experts.gate_up_proj`` [E, in, 2·out] and its bias: gate, up, gate, up, ...).
- ``halves``: the last axis is two leaves one after the other (Llama 4's stacked ``experts.gate_up_proj``
  [E, in, 2·out]: gate, then up).

A rule with an ``index`` maps its HF tensor to entry ``index`` of the leading (expert) axis of its leaf: a
mixture of experts' per-expert tensors (``experts.<e>.w1.weight``) fill one stacked leaf together, and every
expert of every layer has its rule, so a missing or extra expert is named.

Several rules may fill the same leaf (a multi-token-prediction layer's copy of the shared embedding): reading checks
the copies are equal, writing writes each.
"""

import dataclasses
import functools
import re
from typing import Any, Callable, Literal

import numpy as np

from functrain.models import gemma2, gpt2, gpt_oss, llama, llama4, mixtral, phi3
from functrain.models.configs.qwen_moe import QwenMoeOptions
from functrain.models.qwen_moe import QwenMoeConfig

Path = tuple[str, ...]
Kind = Literal["copy", "transpose", "split3", "split_rows", "interleave", "halves"]


def transpose_copy(array: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of a 2-D array's transpose (of each matrix of a 3-D stack), several times faster than
    ``np.ascontiguousarray(a.T)``.

    numpy's plain transposed copy writes one element per destination row and thrashes the cache on big
    matrices; copying bands of a few source rows makes each destination write a short contiguous run.
    """
    if array.ndim == 3:
        return np.stack([transpose_copy(matrix) for matrix in array])
    out = np.empty(array.shape[::-1], array.dtype)
    band = max(1, 32 // array.dtype.itemsize)
    for start in range(0, array.shape[0], band):
        out[:, start : start + band] = array[start : start + band].T
    return out


@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF tensor and the functrain leaves it becomes."""

    hf_name: str
    paths: tuple[Path, ...]
    kind: Kind = "copy"
    sizes: tuple[int, ...] = ()  # split_rows: rows of each block
    index: int | None = None  # the entry of the leaves' leading (expert) axis this tensor is; None: the whole

    def functrain_shapes(self, hf_shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...] | None:
        """Shapes of the leaves (of their ``index`` entry) made from an HF tensor of ``hf_shape``, or None if it
        cannot be split."""
        if self.kind == "transpose":
            return (hf_shape[:-2] + hf_shape[:-3:-1],) if len(hf_shape) in (2, 3) else None
        if self.kind == "split3":
            if not hf_shape or hf_shape[-1] % 3:
                return None
            return (hf_shape[:-1] + (hf_shape[-1] // 3,),) * 3
        if self.kind == "split_rows":
            if len(hf_shape) not in (2, 3) or hf_shape[-2] != sum(self.sizes):
                return None
            return tuple(hf_shape[:-2] + (hf_shape[-1], rows) for rows in self.sizes)
        if self.kind in ("interleave", "halves"):
            if not hf_shape or hf_shape[-1] % 2:
                return None
            return (hf_shape[:-1] + (hf_shape[-1] // 2,),) * 2
        return (tuple(hf_shape),)

    def hf_shape(self, shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
        """The HF tensor shape that becomes leaves of ``shapes`` (the inverse of `functrain_shapes`)."""
        if self.kind == "transpose":
            return shapes[0][:-2] + shapes[0][:-3:-1]
        if self.kind == "split3":
            return shapes[0][:-1] + (3 * shapes[0][-1],)
        if self.kind == "split_rows":
            return shapes[0][:-2] + (sum(shape[-1] for shape in shapes), shapes[0][-2])
        if self.kind in ("interleave", "halves"):
            return shapes[0][:-1] + (2 * shapes[0][-1],)
        return shapes[0]

    def to_functrain(self, array: np.ndarray) -> tuple[np.ndarray, ...]:
        """The functrain leaves (their ``index`` entry) for one HF tensor (each a fresh C-contiguous array)."""
        if self.kind == "transpose":
            return (transpose_copy(array),)
        if self.kind == "split3":
            return tuple(np.ascontiguousarray(part) for part in np.split(array, 3, axis=-1))
        if self.kind == "split_rows":
            return tuple(transpose_copy(part) for part in np.split(array, np.cumsum(self.sizes)[:-1], axis=-2))
        if self.kind == "interleave":
            return np.ascontiguousarray(array[..., 0::2]), np.ascontiguousarray(array[..., 1::2])
        if self.kind == "halves":
            return tuple(np.ascontiguousarray(half) for half in np.split(array, 2, axis=-1))
        return (array,)

    def to_hf(self, leaves: tuple[np.ndarray, ...]) -> np.ndarray:
        """The HF tensor made from this rule's functrain leaves (their ``index`` entry)."""
        if self.kind == "transpose":
            return transpose_copy(np.asarray(leaves[0]))
        if self.kind == "split3":
            return np.concatenate(leaves, axis=-1)
        if self.kind == "split_rows":
            return np.concatenate([transpose_copy(np.asarray(leaf)) for leaf in leaves], axis=-2)
        if self.kind == "interleave":
            first, second = (np.asarray(leaf) for leaf in leaves)
            return np.stack([first, second], axis=-1).reshape(first.shape[:-1] + (2 * first.shape[-1],))
        if self.kind == "halves":
            return np.concatenate(leaves, axis=-1)
        return np.ascontiguousarray(leaves[0])


def _same_name(name: str) -> str:
    return name


def _nothing_left_out(name: str, config: Any) -> str | None:
    return None


def _config_as_is(config: Any, names: set[str]) -> Any:
    return config


@dataclasses.dataclass(frozen=True)
class TensorMapping:
    """How the tensors of an HF architecture are named and laid out: what a family's ``hf_mapping`` names
    (:class:`functrain.models.family.Family`), for each of its ``hf_model_types``."""

    rules: Callable[[Any], list[Rule]]
    ignorable: Callable[[str, Any], bool]  # allow-listed HF tensors with no functrain leaf
    canonical_name: Callable[[str], str] = _same_name  # old exports spell some names differently
    # A second table read when a file holds its names (transformers' in-memory layout, experts fused into one
    # tensor per projection); writing always uses ``rules`` (what transformers' save_pretrained writes).
    fused_rules: Callable[[Any], list[Rule]] | None = None
    # The part of the model an HF tensor belongs to when conversion knowingly leaves it out (named in one log
    # line: DeepSeek-V3's multi-token-prediction layer), else None.
    left_out: Callable[[str, Any], str | None] = _nothing_left_out
    # The config as the file's (canonical) tensor names complete it: config.json may announce a part that HF's own
    # save leaves out (DeepSeek-V3's multi-token-prediction layers), which is then converted without it.
    fit_config: Callable[[Any, set[str]], Any] = _config_as_is


def _linear(hf_prefix: str, path: Path, bias: bool) -> list[Rule]:
    rules = [Rule(f"{hf_prefix}.weight", (path + ("kernel",),), "transpose")]
    if bias:
        rules.append(Rule(f"{hf_prefix}.bias", (path + ("bias",),)))
    return rules


def _gpt2_rules(cfg: gpt2.GPT2Config) -> list[Rule]:
    rules = [
        Rule("transformer.wte.weight", (("wte", "embedding"),)),
        Rule("transformer.wpe.weight", (("wpe", "embedding"),)),
    ]
    for i in range(cfg.n_layer):
        hf, block = f"transformer.h.{i}", f"h_{i}"
        attn = (block, "attn")
        for norm in ("ln_1", "ln_2"):
            rules += [
                Rule(f"{hf}.{norm}.weight", ((block, norm, "scale"),)),
                Rule(f"{hf}.{norm}.bias", ((block, norm, "bias"),)),
            ]
        for param in ("weight", "bias"):
            leaf = "kernel" if param == "weight" else "bias"
            rules.append(Rule(f"{hf}.attn.c_attn.{param}", tuple(attn + (n, leaf) for n in "qkv"), "split3"))
            for hf_mod, path in (
                ("attn.c_proj", attn + ("c_proj",)),
                ("mlp.c_fc", (block, "mlp", "c_fc")),
                ("mlp.c_proj", (block, "mlp", "c_proj")),
            ):
                # Conv1D stores (in, out) already: no transpose.
                rules.append(Rule(f"{hf}.{hf_mod}.{param}", (path + (leaf,),)))
    rules += [Rule("transformer.ln_f.weight", (("ln_f", "scale"),)), Rule("transformer.ln_f.bias", (("ln_f", "bias"),))]
    return rules


def _gpt2_canonical(name: str) -> str:
    # The original OpenAI export (and GPT2Model checkpoints) have no "transformer." prefix.
    if name.startswith(("transformer.", "lm_head.")):
        return name
    return "transformer." + name


_GPT2_BUFFERS = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)")


def _gpt2_ignorable(name: str, cfg: gpt2.GPT2Config) -> bool:
    return bool(_GPT2_BUFFERS.fullmatch(name)) or name == "lm_head.weight"  # GPT-2's head is always tied


# (layer index, HF prefix "model.layers.<i>", functrain prefix "layers_<i>") -> the rules of the layer's MLP.
MlpRules = Callable[[int, str, str], list[Rule]]


def _dense_mlp(hf_prefix: str, path: Path, bias: bool) -> list[Rule]:
    return [
        rule
        for proj in ("gate_proj", "up_proj", "down_proj")
        for rule in _linear(f"{hf_prefix}.{proj}", path + (proj,), bias)
    ]


def _decoder_rules(cfg: llama.LlamaConfig, mlp: MlpRules) -> list[Rule]:
    """The Llama-shaped decoders' table (Llama, Qwen2/3, Mistral, SmolLM3, OLMo 3 and the MoE kin): biases, q/k
    norms and the norms' placement as the config says, each layer's MLP from ``mlp``."""
    rules = [Rule("model.embed_tokens.weight", (("embed_tokens", "embedding"),))]
    # OLMo normalises each sublayer's output, the others its input (functrain.models.llama.LlamaBlock).
    pre_norms = ("input_layernorm", "post_attention_layernorm")
    norms = ("post_attention_layernorm", "post_feedforward_layernorm") if cfg.post_norms else pre_norms
    for i in range(cfg.num_hidden_layers):
        hf, layer = f"model.layers.{i}", f"layers_{i}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            rules += _linear(f"{hf}.self_attn.{proj}", (layer, "self_attn", proj), cfg.qkv_bias)
        rules += _linear(f"{hf}.self_attn.o_proj", (layer, "self_attn", "o_proj"), cfg.o_bias)
        if cfg.qk_norm:
            rules += [
                Rule(f"{hf}.self_attn.{norm}.weight", ((layer, "self_attn", norm, "scale"),))
                for norm in ("q_norm", "k_norm")
            ]
        rules += mlp(i, hf, layer)
        for norm in norms:
            rules.append(Rule(f"{hf}.{norm}.weight", ((layer, norm, "scale"),)))
    rules.append(Rule("model.norm.weight", (("norm", "scale"),)))
    if not cfg.tie_word_embeddings:
        rules += _linear("lm_head", ("lm_head",), bias=False)
    return rules


def _llama_rules(cfg: llama.LlamaConfig) -> list[Rule]:
    """Llama and the families sharing its module (Qwen2/3, Mistral)."""
    return _decoder_rules(cfg, lambda i, hf, layer: _dense_mlp(f"{hf}.mlp", (layer, "mlp"), cfg.mlp_bias))


def _experts(hf_prefix: str, path: Path, count: int, names: tuple[str, str, str]) -> list[Rule]:
    """Per-expert torch Linears ``{hf_prefix}.<e>.<name>.weight`` (``names``: HF's gate, up, down) -> entry ``e``
    of the stacked kernels ``experts/{gate,up,down}_proj``: what transformers' save_pretrained writes."""
    return [
        Rule(f"{hf_prefix}.{e}.{name}.weight", (path + (leaf,),), "transpose", index=e)
        for e in range(count)
        for name, leaf in zip(names, ("gate_proj", "up_proj", "down_proj"))
    ]


def _fused_experts(hf_prefix: str, path: Path, inter: int) -> list[Rule]:
    """transformers' in-memory experts: ``gate_up_proj`` [E, 2 x inter, hidden] (gate rows first) and
    ``down_proj`` [E, hidden, inter]."""
    return [
        Rule(f"{hf_prefix}.gate_up_proj", (path + ("gate_proj",), path + ("up_proj",)), "split_rows", (inter, inter)),
        Rule(f"{hf_prefix}.down_proj", (path + ("down_proj",),), "transpose"),
    ]


def _mixtral_rules(cfg: mixtral.MixtralConfig) -> list[Rule]:
    """Mistral's attention; ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.<e>.w1/w3/w2``."""

    def moe(i: int, hf: str, layer: str) -> list[Rule]:
        router = _linear(f"{hf}.block_sparse_moe.gate", (layer, "mlp", "gate"), bias=False)
        path = (layer, "mlp", "experts")
        return router + _experts(f"{hf}.block_sparse_moe.experts", path, cfg.num_local_experts, ("w1", "w3", "w2"))

    return _decoder_rules(cfg, moe)


def _mixtral_fused_rules(cfg: mixtral.MixtralConfig) -> list[Rule]:
    """Mixtral in transformers' in-memory names (``mlp.gate``, ``mlp.experts.gate_up_proj`` / ``down_proj``)."""

    def moe(i: int, hf: str, layer: str) -> list[Rule]:
        router = _linear(f"{hf}.mlp.gate", (layer, "mlp", "gate"), bias=False)
        return router + _fused_experts(f"{hf}.mlp.experts", (layer, "mlp", "experts"), cfg.intermediate_size)

    return _decoder_rules(cfg, moe)


def _gpt_oss_rules(cfg: gpt_oss.GptOssConfig) -> list[Rule]:
    """Llama's table with each head's sink and a mixture of experts stored stacked, as in memory: a biased
    ``mlp.router``, ``experts.gate_up_proj`` [E, hidden, 2 x inter] (gate and up interleaved) and
    ``experts.down_proj`` [E, inter, hidden], each with its ``_bias``."""

    def moe(i: int, hf: str, layer: str) -> list[Rule]:
        experts = (layer, "mlp", "experts")
        return [
            Rule(f"{hf}.self_attn.sinks", ((layer, "self_attn", "sinks"),)),
            *_linear(f"{hf}.mlp.router", (layer, "mlp", "gate"), bias=True),
            Rule(f"{hf}.mlp.experts.gate_up_proj", (experts + ("gate_proj",), experts + ("up_proj",)), "interleave"),
            Rule(
                f"{hf}.mlp.experts.gate_up_proj_bias",
                (experts + ("gate_proj_bias",), experts + ("up_proj_bias",)),
                "interleave",
            ),
            Rule(f"{hf}.mlp.experts.down_proj", (experts + ("down_proj",),)),
            Rule(f"{hf}.mlp.experts.down_proj_bias", (experts + ("down_proj_bias",),)),
        ]

    return _decoder_rules(cfg, moe)


def _llama4_rules(cfg: llama4.Llama4TextConfig) -> list[Rule]:
    """Llama's table with each layer's ``feed_forward``: on a layer with experts its ``router``, the stacked
    ``experts.gate_up_proj`` [E, hidden, 2 x inter] (gate, then up) and ``experts.down_proj`` [E, inter, hidden] as
    transformers stores them, and the ``shared_expert``; on the others Llama's MLP."""

    def feed_forward(i: int, hf: str, layer: str) -> list[Rule]:
        path = (layer, "mlp")
        if not cfg.moe_layer(i):
            return _dense_mlp(f"{hf}.feed_forward", path, bias=False)
        experts, hf_experts = path + ("experts",), f"{hf}.feed_forward.experts"
        return [
            *_linear(f"{hf}.feed_forward.router", path + ("gate",), bias=False),
            Rule(f"{hf_experts}.gate_up_proj", (experts + ("gate_proj",), experts + ("up_proj",)), "halves"),
            Rule(f"{hf_experts}.down_proj", (experts + ("down_proj",),)),
            *_dense_mlp(f"{hf}.feed_forward.shared_expert", path + ("shared_expert",), bias=False),
        ]

    return _decoder_rules(cfg, feed_forward)


def qwen_moe_mlp(cfg: QwenMoeOptions, fused: bool = False) -> MlpRules:
    """The MLP rules of the Qwen MoEs (Qwen3-Next's and Qwen3.5's too): sparse layers ``mlp.gate`` and
    ``mlp.experts.<e>.{gate,up,down}_proj`` (or the fused ``mlp.experts.gate_up_proj`` / ``down_proj``), with a shared
    expert ``mlp.shared_expert`` and its ``shared_expert_gate``; dense layers Llama's MLP."""

    def mlp(i: int, hf: str, layer: str) -> list[Rule]:
        path = (layer, "mlp")
        if not cfg.moe_layer(i):
            return _dense_mlp(f"{hf}.mlp", path, bias=False)
        rules = _linear(f"{hf}.mlp.gate", path + ("gate",), bias=False)
        if fused:
            rules += _fused_experts(f"{hf}.mlp.experts", path + ("experts",), cfg.moe_intermediate_size)
        else:
            names = ("gate_proj", "up_proj", "down_proj")
            rules += _experts(f"{hf}.mlp.experts", path + ("experts",), cfg.num_experts, names)
        if cfg.shared_expert_size():
            rules += _dense_mlp(f"{hf}.mlp.shared_expert", path + ("shared_expert",), bias=False)
            rules += _linear(f"{hf}.mlp.shared_expert_gate", path + ("shared_expert_gate",), bias=False)
        return rules

    return mlp


def _qwen_moe_rules(cfg: QwenMoeConfig, fused: bool = False) -> list[Rule]:
    """Qwen2/3's attention and :func:`qwen_moe_mlp`."""
    return _decoder_rules(cfg, qwen_moe_mlp(cfg, fused))


def _phi3_rules(cfg: phi3.Phi3Config) -> list[Rule]:
    """Llama's table with q/k/v and gate/up fused into one torch Linear each."""
    q_rows, kv_rows = cfg.num_attention_heads * cfg.attn_head_dim, cfg.kv_heads * cfg.attn_head_dim
    fused = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    rules = [rule for rule in _llama_rules(cfg) if not any(f".{name}." in rule.hf_name for name in fused)]
    for i in range(cfg.num_hidden_layers):
        hf, layer = f"model.layers.{i}", f"layers_{i}"
        rules += [
            Rule(
                f"{hf}.self_attn.qkv_proj.weight",
                tuple((layer, "self_attn", p, "kernel") for p in ("q_proj", "k_proj", "v_proj")),
                "split_rows",
                (q_rows, kv_rows, kv_rows),
            ),
            Rule(
                f"{hf}.mlp.gate_up_proj.weight",
                tuple((layer, "mlp", p, "kernel") for p in ("gate_proj", "up_proj")),
                "split_rows",
                (cfg.intermediate_size,) * 2,
            ),
        ]
    return rules


def _gemma2_rules(cfg: gemma2.Gemma2Config) -> list[Rule]:
    """Gemma 2 and 3 (text)."""
    rules = [Rule("model.embed_tokens.weight", (("embed_tokens", "embedding"),))]
    for i in range(cfg.num_hidden_layers):
        hf, layer = f"model.layers.{i}", f"layers_{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            rules += _linear(f"{hf}.self_attn.{proj}", (layer, "self_attn", proj), cfg.attention_bias)
        if cfg.qk_norm:  # Gemma 3
            rules += [
                Rule(f"{hf}.self_attn.{norm}.weight", ((layer, "self_attn", norm, "scale"),))
                for norm in ("q_norm", "k_norm")
            ]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            rules += _linear(f"{hf}.mlp.{proj}", (layer, "mlp", proj), False)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            rules.append(Rule(f"{hf}.{norm}.weight", ((layer, norm, "scale"),)))  # zero-centred in both
    rules.append(Rule("model.norm.weight", (("norm", "scale"),)))
    return rules


def _gemma2_ignorable(name: str, cfg: gemma2.Gemma2Config) -> bool:
    return name == "lm_head.weight" or name == "model.embed_tokens.embed_scale"  # tied head; a buffer


_LLAMA_BUFFERS = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


def _llama_ignorable(name: str, cfg: llama.LlamaConfig) -> bool:
    return bool(_LLAMA_BUFFERS.fullmatch(name)) or (cfg.tie_word_embeddings and name == "lm_head.weight")


# The tables the families' declarations name (``hf_mapping``): Llama's serves the families sharing its module and
# tensor names (Mistral, Qwen2, Qwen3), Gemma 2's Gemma 3 (text), and the Qwen MoEs share theirs.
# DeepSeek-V3's and GLM-4.5's are in torch_bridge.hf.deepseek_mappings, the hybrids' in torch_bridge.hf.hybrid_mappings.
GPT2 = TensorMapping(_gpt2_rules, _gpt2_ignorable, canonical_name=_gpt2_canonical)
LLAMA = TensorMapping(_llama_rules, _llama_ignorable)
PHI3 = TensorMapping(_phi3_rules, _llama_ignorable)
GEMMA2 = TensorMapping(_gemma2_rules, _gemma2_ignorable)
GPT_OSS = TensorMapping(_gpt_oss_rules, _llama_ignorable)
LLAMA4 = TensorMapping(_llama4_rules, _llama_ignorable)
MIXTRAL = TensorMapping(_mixtral_rules, _llama_ignorable, fused_rules=_mixtral_fused_rules)
QWEN_MOE = TensorMapping(_qwen_moe_rules, _llama_ignorable, fused_rules=functools.partial(_qwen_moe_rules, fused=True))
