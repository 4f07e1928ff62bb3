"""The model configuration, read from a Hugging-Face ``config.json``.

Two layouts of the same architecture family are understood:

- ``mixtral`` (Mixtral-8x7B and friends): keys ``num_local_experts``, ``num_experts_per_tok``,
  ``intermediate_size`` (the expert MLP width); every layer is a MoE layer; routing weights are
  always renormalized over the chosen top-k.
- ``qwen2_moe`` (Qwen1.5-MoE / Qwen2-MoE): keys ``num_experts``, ``moe_intermediate_size``,
  ``norm_topk_prob``, an optional shared expert (``shared_expert_intermediate_size``) and dense
  layers (``mlp_only_layers``, ``decoder_sparse_step``) whose MLP width is ``intermediate_size``;
  q/k/v projections carry biases.
- ``qwen3_moe`` (Qwen3-MoE): the Qwen2-MoE keys without a shared expert, plus a per-head RMSNorm
  of q and k (``q_norm``, ``k_norm``) before RoPE; ``attention_bias`` puts a bias on q/k/v/o.
- ``deepseek_v3`` (DeepSeek-V3): multi-head latent attention (:class:`MLAConfig`), dense first
  layers (``first_k_dense_replace``), ``n_shared_experts`` ungated shared experts, sigmoid
  routing with ``e_score_correction_bias``, group-limited top-k (``n_group``, ``topk_group``)
  and ``routed_scaling_factor`` (see :mod:`moecomm_serving.model.deepseek`).

transformers 5 writes the expert count of the Qwen families as ``num_local_experts`` and the rope
as ``rope_parameters``; 4.x wrote ``num_experts`` and ``rope_theta`` / ``rope_scaling``. Both
are read (see :mod:`moecomm_serving.model.rope` for the rope types).

Keys that only matter for training (dropout, aux-loss coefficients, router jitter) are ignored.
Keys that would change what inference computes and that this model does not implement (rope
types other than default/linear/yarn, sliding-window attention, activations other than SiLU,
quantized weights) raise :class:`UnsupportedConfigError` naming the key, rather than silently
computing something else.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from moecomm.errors import MoecommError

from moecomm_serving.model.rope import RopeConfig, UnsupportedRopeError, read_rope

MIXTRAL = "mixtral"
QWEN2_MOE = "qwen2_moe"
QWEN3_MOE = "qwen3_moe"
DEEPSEEK_V3 = "deepseek_v3"
SUPPORTED_MODEL_TYPES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE, DEEPSEEK_V3)
QWEN_FAMILIES = (QWEN2_MOE, QWEN3_MOE)

# HF defaults used when a key is absent (the values of transformers' config classes).
DEFAULT_RMS_NORM_EPS = 1e-5  # MixtralConfig default; Qwen2MoeConfig uses 1e-6 (set below)
DEFAULT_ROPE_THETA = 1e6  # MixtralConfig default rope_theta
DEFAULT_MAX_POSITIONS = 4096 * 32  # MixtralConfig default max_position_embeddings
# Qwen2MoeConfig / Qwen3MoeConfig defaults.
QWEN_RMS_NORM_EPS = 1e-6
QWEN_ROPE_THETA = 10000.0
QWEN_MAX_POSITIONS = 32768
# DeepseekV3Config defaults (an absent key means these, as in transformers).
DEEPSEEK_MAX_POSITIONS = 4096
DEEPSEEK_ROPE_THETA = 10000.0
DEEPSEEK_DEFAULTS = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "rope_interleave": True,
}
# Frozen, so one shared default is safe.
MIXTRAL_DEFAULT_ROPE = RopeConfig(theta=DEFAULT_ROPE_THETA)


class UnsupportedConfigError(MoecommError, ValueError):
    """The checkpoint asks for an architecture feature this model does not implement."""


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V3's attention and routing parameters (absent for the other families).

    Each head's query/key is ``qk_nope_head_dim`` unrotated dimensions followed by
    ``qk_rope_head_dim`` rotated ones (one rotated key shared by all heads); keys and values are
    decompressed from a ``kv_lora_rank`` latent. ``q_lora_rank`` None means a plain ``q_proj``.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Everything the model needs, in one naming for both layouts.

    ``sparse_layers`` lists the layers whose MLP is a routed MoE block (all of them for Mixtral);
    the others have a dense SwiGLU MLP of width ``dense_intermediate_size``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    shared_expert_intermediate_size: int = 0
    dense_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS
    rope: RopeConfig = MIXTRAL_DEFAULT_ROPE
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    mla: MLAConfig | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
        )
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"config: {name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"config: num_experts_per_tok ({self.num_experts_per_tok}) exceeds the number "
                f"of experts ({self.num_experts})"
            )
        bad = [i for i in self.sparse_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"config: sparse layer ids {bad} outside [0, {self.num_hidden_layers})"
            )
        if self.mla is not None:
            _check_mla(self.mla, self.num_experts, self.num_experts_per_tok)
        dense = [i for i in range(self.num_hidden_layers) if i not in self.sparse_layers]
        if dense and self.dense_intermediate_size <= 0:
            raise ValueError(f"config: dense layers {dense} need a positive intermediate_size")

    @property
    def num_kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoEConfig:
        """Reads a HF config dict (the content of ``config.json``)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"config: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}; architectures "
                f"{d.get('architectures')})"
            )
        _reject_unsupported(d)
        get = _getter(d)
        hidden = get("hidden_size")
        heads = get("num_attention_heads")
        layers = get("num_hidden_layers")
        qwen = model_type in QWEN_FAMILIES
        if model_type == DEEPSEEK_V3:
            return _deepseek(cls, d, get)
        max_positions = d.get(
            "max_position_embeddings", QWEN_MAX_POSITIONS if qwen else DEFAULT_MAX_POSITIONS
        )
        common = {
            "model_type": model_type,
            "vocab_size": get("vocab_size"),
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": d.get("num_key_value_heads") or heads,
            "head_dim": d.get("head_dim") or _head_dim(hidden, heads),
            "num_experts_per_tok": get("num_experts_per_tok"),
            "rope": _rope(d, QWEN_ROPE_THETA if qwen else DEFAULT_ROPE_THETA, max_positions),
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
            "bos_token_id": d.get("bos_token_id"),
            "eos_token_id": _first_eos(d.get("eos_token_id")),
            "pad_token_id": d.get("pad_token_id"),
            "torch_dtype": d.get("torch_dtype") or d.get("dtype") or "float32",
            "raw": dict(d),
        }
        if model_type == MIXTRAL:
            return cls(
                num_experts=get("num_local_experts"),
                moe_intermediate_size=get("intermediate_size"),
                norm_topk_prob=True,  # Mixtral always renormalizes over the chosen top-k
                attention_bias=bool(d.get("attention_bias", False)),
                sparse_layers=tuple(range(layers)),
                rms_norm_eps=float(d.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS)),
                **common,
            )
        # transformers 5 saves the Qwen expert count under its attribute-map name.
        num_experts = d.get("num_experts", d.get("num_local_experts"))
        if num_experts is None:
            raise ValueError(f"config: required key 'num_experts' is missing ({model_type})")
        step = d.get("decoder_sparse_step", 1)
        mlp_only = set(d.get("mlp_only_layers") or [])
        sparse = tuple(
            i
            for i in range(layers)
            if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
        )
        if model_type == QWEN2_MOE:
            # Qwen2-MoE's q/k/v projections always carry a bias (o_proj never does).
            bias = {"attention_bias": bool(d.get("qkv_bias", True))}
            shared = int(d.get("shared_expert_intermediate_size") or 0)
        else:
            # Qwen3-MoE: one attention_bias flag for q/k/v/o, per-head q/k norms, no shared
            # expert.
            qwen3_bias = bool(d.get("attention_bias", False))
            bias = {"attention_bias": qwen3_bias, "o_proj_bias": qwen3_bias, "qk_norm": True}
            shared = 0
        return cls(
            num_experts=num_experts,
            moe_intermediate_size=get("moe_intermediate_size"),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=shared,
            dense_intermediate_size=int(d.get("intermediate_size") or 0),
            sparse_layers=sparse,
            rms_norm_eps=float(d.get("rms_norm_eps", QWEN_RMS_NORM_EPS)),
            **bias,
            **common,
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> MoEConfig:
        """Reads ``config.json`` (or ``path/config.json`` when given a directory)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        return cls.from_dict(d)


def _deepseek(cls, d: dict[str, Any], get) -> MoEConfig:
    """A DeepSeek-V3 config; ``head_dim`` is the rotated width (what RoPE turns)."""
    layers, heads = get("num_hidden_layers"), get("num_attention_heads")
    max_positions = d.get("max_position_embeddings", DEEPSEEK_MAX_POSITIONS)
    # transformers 5 may write the routed-expert count under its attribute-map name.
    num_experts = d.get("n_routed_experts", d.get("num_local_experts"))
    if num_experts is None:
        raise ValueError("config: required key 'n_routed_experts' is missing (deepseek_v3)")
    kv_heads = d.get("num_key_value_heads") or heads
    if kv_heads != heads:
        # MLA decompresses one key/value per query head; transformers' grouped repeat would
        # not even fit shapes, so a different count is a malformed config.
        raise UnsupportedConfigError(
            f"config: num_key_value_heads {kv_heads} != num_attention_heads {heads} "
            "is not supported for deepseek_v3"
        )
    given, d = d, {**DEEPSEEK_DEFAULTS, **d}
    mla = MLAConfig(
        q_lora_rank=d["q_lora_rank"],
        kv_lora_rank=d["kv_lora_rank"],
        qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"],
        v_head_dim=d["v_head_dim"],
        rope_interleave=bool(d["rope_interleave"]),
        n_shared_experts=int(d["n_shared_experts"] or 0),
        routed_scaling_factor=float(d["routed_scaling_factor"]),
        n_group=d["n_group"],
        topk_group=d["topk_group"],
    )
    first_dense = int(d["first_k_dense_replace"] or 0)
    moe_inter = get("moe_intermediate_size")
    return cls(
        model_type=DEEPSEEK_V3,
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=mla.qk_rope_head_dim,
        num_experts=num_experts,
        num_experts_per_tok=get("num_experts_per_tok"),
        moe_intermediate_size=moe_inter,
        norm_topk_prob=bool(d["norm_topk_prob"]),
        attention_bias=bool(d.get("attention_bias", False)),
        o_proj_bias=bool(d.get("attention_bias", False)),
        shared_expert_intermediate_size=moe_inter * mla.n_shared_experts,
        dense_intermediate_size=int(d.get("intermediate_size") or 0),
        sparse_layers=tuple(range(first_dense, layers)),
        rms_norm_eps=float(d.get("rms_norm_eps", QWEN_RMS_NORM_EPS)),
        rope=_rope(d, DEEPSEEK_ROPE_THETA, max_positions),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=_first_eos(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"),
        torch_dtype=d.get("torch_dtype") or d.get("dtype") or "float32",
        mla=mla,
        raw=dict(given),
    )


def _check_mla(m: MLAConfig, num_experts: int, top_k: int) -> None:
    dims = (
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_group",
        "topk_group",
    )
    for name in (*dims, *(("q_lora_rank",) if m.q_lora_rank is not None else ())):
        v = getattr(m, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"config: {name} must be a positive integer, got {v!r}")
    if num_experts % m.n_group:
        raise ValueError(f"config: n_routed_experts {num_experts} not divisible by n_group")
    per_group = num_experts // m.n_group
    # A group's score is the sum of its two best experts, and the chosen groups must hold at
    # least top-k experts.
    if per_group < 2 or not 0 < m.topk_group <= m.n_group or m.topk_group * per_group < top_k:
        raise ValueError(
            f"config: n_group {m.n_group} / topk_group {m.topk_group} cannot select top-{top_k} "
            f"of {num_experts} experts"
        )


def _getter(d: dict[str, Any]):
    def get(key: str) -> Any:
        if key not in d:
            raise ValueError(
                f"config: required key {key!r} is missing (model_type {d['model_type']})"
            )
        return d[key]

    return get


def _rope(d: dict[str, Any], default_theta: float, max_positions: int) -> RopeConfig:
    try:
        return read_rope(d, default_theta, max_positions)
    except UnsupportedRopeError as exc:
        raise UnsupportedConfigError(str(exc)) from None


def _head_dim(hidden: int, heads: int) -> int:
    if hidden % heads:
        raise ValueError(
            f"config: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
            "and no head_dim is given"
        )
    return hidden // heads


def _first_eos(eos: Any) -> int | None:
    # Some configs list several end-of-sequence ids; the first is the one written at the end.
    if isinstance(eos, list):
        return int(eos[0]) if eos else None
    return eos


def _reject_unsupported(d: dict[str, Any]) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedConfigError(f"config: hidden_act {act!r} is not supported (only 'silu')")
    if d.get("model_type") in QWEN_FAMILIES and d.get("use_sliding_window"):
        raise UnsupportedConfigError("config: use_sliding_window=true is not supported")
    if d.get("model_type") == MIXTRAL and d.get("sliding_window") is not None:
        window, max_pos = d["sliding_window"], d.get("max_position_embeddings", 0)
        if window < max_pos:
            raise UnsupportedConfigError(
                f"config: sliding_window={window} (< max_position_embeddings {max_pos}) is not "
                "supported; only full causal attention is implemented"
            )
    # transformers 5 lists each layer's attention kind; only full attention is implemented.
    kinds = sorted(set(d.get("layer_types") or ()) - {"full_attention"})
    if kinds:
        raise UnsupportedConfigError(f"config: layer_types {kinds} are not supported")
    if d.get("model_type") == DEEPSEEK_V3:
        # The original DeepSeek config names its router; only the V3 one is implemented.
        for key, implemented in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if d.get(key, implemented) != implemented:
                raise UnsupportedConfigError(f"config: {key} {d[key]!r} is not supported")
    if d.get("quantization_config"):
        raise UnsupportedConfigError(
            "config: quantized checkpoints (quantization_config) are not supported"
        )
