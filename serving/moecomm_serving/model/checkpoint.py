"""Hugging-Face-layout checkpoints: ``config.json`` + ``*.safetensors`` with HF tensor names.

Loading is strict. Every tensor name and shape in every ``*.safetensors`` file is checked against
the full list the config implies (from the file headers, without reading any data), so a
missing tensor, an unexpected one or a wrong shape is an error naming the tensor, whatever part
is being loaded. Only the selected tensors are then read: an attention client can load its layer
range without the experts, and an expert server just the experts it hosts.

Names (``{i}`` layer, ``{e}`` expert):

- everywhere: ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` (absent
  with tied embeddings), ``model.layers.{i}.input_layernorm.weight``,
  ``model.layers.{i}.post_attention_layernorm.weight``,
  ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (+ ``{q,k,v}_proj.bias`` when the config
  has attention biases);
- Mixtral MoE: ``model.layers.{i}.block_sparse_moe.gate.weight``,
  ``model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w2,w3}.weight``;
- Qwen2-MoE MoE: ``model.layers.{i}.mlp.gate.weight``,
  ``model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight``, and with a shared
  expert ``model.layers.{i}.mlp.shared_expert.{gate_proj,up_proj,down_proj}.weight`` and
  ``model.layers.{i}.mlp.shared_expert_gate.weight``; dense layers
  ``model.layers.{i}.mlp.{gate_proj,up_proj,down_proj}.weight``;
- Qwen3-MoE: the Qwen2-MoE names without shared expert, plus
  ``model.layers.{i}.self_attn.{q,k}_norm.weight`` and, with ``attention_bias``, biases on
  q/k/v/o;
- DeepSeek-V3: attention ``self_attn.{q_a_proj,q_a_layernorm,q_b_proj}.weight`` (or
  ``self_attn.q_proj.weight`` without ``q_lora_rank``),
  ``self_attn.{kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,o_proj}.weight`` (with
  ``attention_bias``, biases on q_a/kv_a/o); the Qwen2-MoE expert, router and dense names plus
  ``mlp.gate.e_score_correction_bias`` and ``mlp.shared_experts.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from moecomm.errors import MoecommError
from moecomm.runtime.experts import ExpertWeights
from safetensors import safe_open
from safetensors.torch import save_file

from moecomm_serving.model.config import MIXTRAL, MoEConfig

# Older checkpoints store RoPE's inverse frequencies as buffers; they are recomputed, not loaded.
IGNORED_NAME = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype codes of the weights this model computes with (all are cast on load).
FLOAT_DTYPES = ("F32", "F16", "BF16")


class CheckpointError(MoecommError, ValueError):
    """A checkpoint does not match what its config implies."""


@dataclass(frozen=True)
class ExpertNames:
    """HF names of one layout's routed experts: gate (w1), up (w3), down (w2), router."""

    block: str
    gate: str
    up: str
    down: str

    def expert(self, layer: int, e: int) -> dict[str, str]:
        p = f"model.layers.{layer}.{self.block}.experts.{e}"
        return {
            "w1": f"{p}.{self.gate}.weight",
            "w3": f"{p}.{self.up}.weight",
            "w2": f"{p}.{self.down}.weight",
        }

    def router(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.block}.gate.weight"


MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
QWEN2_MOE_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")


def expert_names(config: MoEConfig) -> ExpertNames:
    return MIXTRAL_NAMES if config.model_type == MIXTRAL else QWEN2_MOE_NAMES


def _swiglu(prefix: str, inter: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


def layer_names(config: MoEConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Non-expert tensors of one decoder layer (attention, norms, router, dense/shared MLP)."""
    if config.mla is not None:
        return _mla_layer_names(config, layer)
    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    p = f"model.layers.{layer}"
    names = {
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
        f"{p}.self_attn.q_proj.weight": (q_out, h),
        f"{p}.self_attn.k_proj.weight": (kv_out, h),
        f"{p}.self_attn.v_proj.weight": (kv_out, h),
        f"{p}.self_attn.o_proj.weight": (h, q_out),
    }
    if config.attention_bias:
        names[f"{p}.self_attn.q_proj.bias"] = (q_out,)
        names[f"{p}.self_attn.k_proj.bias"] = (kv_out,)
        names[f"{p}.self_attn.v_proj.bias"] = (kv_out,)
    if config.o_proj_bias:
        names[f"{p}.self_attn.o_proj.bias"] = (h,)
    if config.qk_norm:
        names[f"{p}.self_attn.q_norm.weight"] = (d,)
        names[f"{p}.self_attn.k_norm.weight"] = (d,)
    if not config.is_sparse(layer):
        names.update(_swiglu(f"{p}.mlp", config.dense_intermediate_size, h))
        return names
    names[expert_names(config).router(layer)] = (config.num_experts, h)
    if config.shared_expert_intermediate_size:
        names.update(_swiglu(f"{p}.mlp.shared_expert", config.shared_expert_intermediate_size, h))
        names[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
    return names


def _mla_layer_names(config: MoEConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's layer: latent attention, then a dense MLP or router + shared experts."""
    m, h, heads = config.mla, config.hidden_size, config.num_attention_heads
    p = f"model.layers.{layer}"
    a = f"{p}.self_attn"
    names = {
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
        f"{a}.kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
        f"{a}.kv_a_layernorm.weight": (m.kv_lora_rank,),
        f"{a}.kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        f"{a}.o_proj.weight": (h, heads * m.v_head_dim),
    }
    if m.q_lora_rank is None:
        names[f"{a}.q_proj.weight"] = (heads * m.qk_head_dim, h)
    else:
        names[f"{a}.q_a_proj.weight"] = (m.q_lora_rank, h)
        names[f"{a}.q_a_layernorm.weight"] = (m.q_lora_rank,)
        names[f"{a}.q_b_proj.weight"] = (heads * m.qk_head_dim, m.q_lora_rank)
    if config.attention_bias:
        if m.q_lora_rank is not None:
            names[f"{a}.q_a_proj.bias"] = (m.q_lora_rank,)
        names[f"{a}.kv_a_proj_with_mqa.bias"] = (m.kv_lora_rank + m.qk_rope_head_dim,)
        names[f"{a}.o_proj.bias"] = (h,)
    if not config.is_sparse(layer):
        names.update(_swiglu(f"{p}.mlp", config.dense_intermediate_size, h))
        return names
    names[expert_names(config).router(layer)] = (config.num_experts, h)
    names[f"{p}.mlp.gate.e_score_correction_bias"] = (config.num_experts,)
    if config.shared_expert_intermediate_size:
        names.update(_swiglu(f"{p}.mlp.shared_experts", config.shared_expert_intermediate_size, h))
    return names


def expert_tensor_names(config: MoEConfig, layer: int, e: int) -> dict[str, tuple[int, ...]]:
    h, i = config.hidden_size, config.moe_intermediate_size
    n = expert_names(config).expert(layer, e)
    return {n["w1"]: (i, h), n["w3"]: (i, h), n["w2"]: (h, i)}


def global_names(config: MoEConfig, embed: bool, head: bool) -> dict[str, tuple[int, ...]]:
    """Embedding (first stage, or last with tied embeddings), final norm and lm_head (last)."""
    v, h = config.vocab_size, config.hidden_size
    names: dict[str, tuple[int, ...]] = {}
    if embed or (head and config.tie_word_embeddings):
        names["model.embed_tokens.weight"] = (v, h)
    if head:
        names["model.norm.weight"] = (h,)
        if not config.tie_word_embeddings:
            names["lm_head.weight"] = (v, h)
    return names


def expected_tensors(config: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the whole checkpoint must hold, with its shape."""
    names = global_names(config, embed=True, head=True)
    for layer in range(config.num_hidden_layers):
        names.update(layer_names(config, layer))
        if config.is_sparse(layer):
            for e in range(config.num_experts):
                names.update(expert_tensor_names(config, layer, e))
    return names


class Checkpoint:
    """A checkpoint directory whose tensor table was checked against its config.

    Nothing but the headers is read on construction; :meth:`read` loads chosen tensors.
    """

    def __init__(self, path: str | os.PathLike, config: MoEConfig | None = None):
        self.path = os.fspath(path)
        self.config = config or MoEConfig.from_file(self.path)
        self.files = _tensor_files(self.path)  # name -> file holding it
        self._check()

    def _check(self) -> None:
        expected = expected_tensors(self.config)
        found = {n: f for n, f in self.files.items() if not IGNORED_NAME.fullmatch(n)}
        missing = sorted(set(expected) - set(found))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{self.path}: missing tensor {missing[0]}{more}")
        unexpected = sorted(set(found) - set(expected))
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise CheckpointError(
                f"{self.path}: unexpected tensor {unexpected[0]}{more} for a "
                f"{self.config.model_type} config"
            )
        by_file: dict[str, list[str]] = {}
        for n, f in found.items():
            by_file.setdefault(f, []).append(n)
        for f, names in sorted(by_file.items()):
            with safe_open(f, framework="pt") as sf:
                for n in names:
                    info = sf.get_slice(n)
                    shape = tuple(info.get_shape())
                    if shape != expected[n]:
                        raise CheckpointError(
                            f"{os.path.basename(f)}: tensor {n} has shape {list(shape)}, "
                            f"expected {list(expected[n])} from config.json"
                        )
                    if info.get_dtype() not in FLOAT_DTYPES:
                        raise CheckpointError(
                            f"{os.path.basename(f)}: tensor {n} has dtype {info.get_dtype()}, "
                            f"expected one of {', '.join(FLOAT_DTYPES)}"
                        )

    def read(
        self,
        names: Iterable[str],
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> dict[str, torch.Tensor]:
        """Loads `names` (opening each file once), cast to `dtype` when given."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            if n not in self.files:
                raise CheckpointError(f"{self.path}: no tensor {n}")
            by_file.setdefault(self.files[n], []).append(n)
        out = {}
        for f, ns in by_file.items():
            with safe_open(f, framework="pt", device=str(device)) as sf:
                for n in ns:
                    t = sf.get_tensor(n)
                    out[n] = t if dtype is None else t.to(dtype)
        return out

    def read_experts(
        self,
        hosted: Mapping[int, Iterable[int]],
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> dict[int, dict[int, ExpertWeights]]:
        """``{layer: {expert: ExpertWeights}}`` for the hosted experts only (an expert server)."""
        cfg = self.config
        wanted: dict[tuple[int, int], dict[str, str]] = {}
        for layer, experts in hosted.items():
            if not cfg.is_sparse(layer):
                raise CheckpointError(f"layer {layer} is not a MoE layer; it has no experts")
            for e in experts:
                if not 0 <= e < cfg.num_experts:
                    raise CheckpointError(
                        f"layer {layer}: expert {e} outside [0, {cfg.num_experts})"
                    )
                wanted[(layer, e)] = expert_names(cfg).expert(layer, e)
        flat = self.read([n for d in wanted.values() for n in d.values()], dtype, device)
        out: dict[int, dict[int, ExpertWeights]] = {}
        for (layer, e), d in sorted(wanted.items()):
            out.setdefault(layer, {})[e] = ExpertWeights(
                flat[d["w1"]], flat[d["w3"]], flat[d["w2"]]
            )
        return out


def _tensor_files(path: str) -> dict[str, str]:
    """Maps every tensor name to its file; an index file, when present, must agree."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    names: dict[str, str] = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for n in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                if n in names:
                    raise CheckpointError(
                        f"{path}: tensor {n} is in both {os.path.basename(names[n])} "
                        f"and {os.path.basename(f)}"
                    )
                names[n] = f
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map", {})
        for n, f in names.items():
            if weight_map.get(n) != os.path.basename(f):
                raise CheckpointError(
                    f"{INDEX_FILE}: tensor {n} is listed in {weight_map.get(n)!r} "
                    f"but stored in {os.path.basename(f)}"
                )
    return names


def save_checkpoint(
    path: str | os.PathLike,
    config: Mapping,
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int | None = None,
) -> None:
    """Writes ``config.json`` and the tensors as HF-style shards (with an index when several)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(config), f, indent=2, sort_keys=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for n in sorted(tensors, key=_natural_key):
        t = tensors[n].contiguous()
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _natural_key(name: str) -> list:
    # layers.10 after layers.9, so shards hold consecutive layers like HF's do
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
