"""One decoder layer of the reference MoE transformer (Mixtral / Qwen2-MoE / Qwen3-MoE;
DeepSeek-V3's subclass is in :mod:`moecomm_serving.model.deepseek`) and the functions every layer
shares: the linear map, RMSNorm and the SwiGLU MLP. :mod:`moecomm_serving.model.transformer`
stacks the layers into a model."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from moecomm_serving.kv.cache import ForwardBatch
from moecomm_serving.model.checkpoint import expert_names
from moecomm_serving.model.config import MoEConfig
from moecomm_serving.model.experts import ExpertsBackend
from moecomm_serving.model.rope import Rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalize in float32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


class DecoderLayer:
    """One layer's non-expert weights, under their HF names minus ``model.layers.{i}.``.

    The MoE step is split (:meth:`attention`, :meth:`route`, :meth:`finish`) so a scheduler can
    hand the routed tokens to the experts and do other work before taking the answer back.
    """

    def __init__(self, config: MoEConfig, layer: int, w: Mapping[str, torch.Tensor]):
        self.config = config
        self.layer = layer
        self.sparse = config.is_sparse(layer)
        self.w = dict(w)
        self.router_name = expert_names(config).router(layer).split(f"layers.{layer}.", 1)[1]
        self.scale = config.head_dim**-0.5

    def attention(self, h: torch.Tensor, batch: ForwardBatch, rope: Rotary) -> torch.Tensor:
        """``h + o_proj(attention(input_layernorm(h)))`` for all sequences of the batch."""
        c, w = self.config, self.w
        x = rms_norm(h, w["input_layernorm.weight"], c.rms_norm_eps)
        t, d = x.shape[0], c.head_dim
        q = linear(x, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"))
        k = linear(x, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias"))
        v = linear(x, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias"))
        q, k = q.view(t, c.num_attention_heads, d), k.view(t, c.num_key_value_heads, d)
        if c.qk_norm:  # Qwen3: RMSNorm over each head's dimensions, before the rotation
            q = rms_norm(q, w["self_attn.q_norm.weight"], c.rms_norm_eps)
            k = rms_norm(k, w["self_attn.k_norm.weight"], c.rms_norm_eps)
        q, k = rope(q, batch.positions), rope(k, batch.positions)
        v = v.view(t, c.num_key_value_heads, d)
        out = torch.empty_like(q)
        for cache, start, n, past in zip(
            batch.caches, batch.starts, batch.num_new, batch.past, strict=True
        ):
            rows = slice(start, start + n)
            keys, values = cache.layer(self.layer).append(
                k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            )
            out[rows] = self._attend(q[rows], keys, values, past)
        o_bias = w.get("self_attn.o_proj.bias")
        return h + linear(out.reshape(t, -1), w["self_attn.o_proj.weight"], o_bias)

    def _attend(self, q, keys, values, past: int) -> torch.Tensor:
        """q ``[n, Hq, D]`` against the cache ``[Hkv, L, D]``; query i sits at ``past + i``."""
        c = self.config
        n, length = q.shape[0], keys.shape[1]
        # [Hkv, G, n, D]: the G query heads of a group share their key/value head.
        qg = q.float().transpose(0, 1).reshape(c.num_key_value_heads, c.num_kv_groups, n, -1)
        scores = (qg @ keys.float()[:, None].transpose(-1, -2)) * self.scale
        q_pos = torch.arange(past, past + n, device=q.device)[:, None]
        future = torch.arange(length, device=q.device)[None, :] > q_pos  # causal mask
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = probs @ values.float()[:, None]  # [Hkv, G, n, D]
        return o.reshape(c.num_attention_heads, n, -1).transpose(0, 1).to(q.dtype)

    def mlp_input(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.w["post_attention_layernorm.weight"], self.config.rms_norm_eps)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts of every row: ``(ids [T, K] int32, weights [T, K] float32)``."""
        logits = linear(x, self.w[self.router_name])
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.config.num_experts_per_tok, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids.to(torch.int32), weights

    def finish(self, h: torch.Tensor, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """``h + routed + shared_expert(x)``; `routed` is the experts' combined answer."""
        y = routed.to(h.dtype)
        if self.config.shared_expert_intermediate_size:
            w = self.w
            shared = swiglu(
                x,
                w["mlp.shared_expert.gate_proj.weight"],
                w["mlp.shared_expert.up_proj.weight"],
                w["mlp.shared_expert.down_proj.weight"],
            )
            y = y + torch.sigmoid(linear(x, w["mlp.shared_expert_gate.weight"])) * shared
        return h + y

    def forward(
        self, h: torch.Tensor, batch: ForwardBatch, rope: Rotary, experts: ExpertsBackend | None
    ) -> torch.Tensor:
        h = self.attention(h, batch, rope)
        x = self.mlp_input(h)
        if not self.sparse:
            w = self.w
            return h + swiglu(
                x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"]
            )
        if experts is None:
            raise RuntimeError(f"layer {self.layer} is a MoE layer but the model has no experts")
        ids, weights = self.route(x)
        routed = experts.combine(experts.dispatch(x, ids, weights, self.layer))
        return self.finish(h, x, routed)
