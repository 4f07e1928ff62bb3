"""DeepSeek-V3's decoder layer: multi-head latent attention (MLA) and its router.

Attention. A query is ``q_b_proj(rms_norm(q_a_proj(x)))`` (or ``q_proj(x)`` without a q LoRA),
split per head into ``qk_nope_head_dim`` unrotated and ``qk_rope_head_dim`` rotated dimensions.
``kv_a_proj_with_mqa(x)`` gives a ``kv_lora_rank`` latent (RMS-normed by ``kv_a_layernorm``) and
one rotated key shared by every head. The KV cache holds exactly these two per token — the
normed latent and the rotated key, ``kv_lora_rank + qk_rope_head_dim`` numbers instead of
``2 * heads * head_dim`` — as DeepSeek serves it; that memory saving is the point of MLA. Keys and
values are decompressed from the cached latents by ``kv_b_proj`` when a step attends.

RoPE. DeepSeek's checkpoints lay the rotated dimensions out as interleaved pairs
``(x0, x1), (x2, x3), ...`` (``rope_interleave``); de-interleaving them (evens, then odds) turns
that into the "rotate half" layout :class:`~moecomm_serving.model.rope.Rotary` applies. Queries and
keys get the same permutation, so their dot products are unchanged. With yarn and
``mscale_all_dim`` the softmax scale is multiplied by ``mscale(factor, mscale_all_dim)**2``
(transformers' DeepSeek-V3 attention does this on top of the cos/sin attention factor).

Router. Sigmoid scores; ``e_score_correction_bias`` is added for the choice only. Experts are in
``n_group`` groups, a group scores the sum of its two best experts, only the ``topk_group`` best
groups are eligible, and the top-k of those are chosen. Weights are the chosen (uncorrected)
scores, renormalized with ``norm_topk_prob``, times ``routed_scaling_factor``: the weights handed
to the experts backend already carry the factor, so an expert server's ``Σ w·expert(x)`` is the
whole routed term.

Shared experts run here, on the attention side: they see every token, which this side already
holds; on an expert server they would add one destination per token, all on that one server (T
tokens per layer against T·K/E per routed expert). They are computed while the routed dispatch
is in flight (between the backend's ``dispatch`` and ``combine``); see docs/model.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moecomm_serving.kv.cache import ForwardBatch
from moecomm_serving.model.config import MoEConfig
from moecomm_serving.model.experts import ExpertsBackend
from moecomm_serving.model.layer import DecoderLayer, rms_norm, swiglu
from moecomm_serving.model.rope import DEFAULT, Rotary, yarn_mscale

# transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default epsilon, not the
# config's rms_norm_eps.
LORA_NORM_EPS = 1e-6
# A group's score is the sum of its best this-many experts (DeepSeek-V3's rule).
GROUP_SCORE_TOP = 2
# Keeps the renormalization finite should every chosen score underflow to zero.
NORM_EPS = 1e-20


def softmax_scale(config: MoEConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under yarn."""
    scale = config.mla.qk_head_dim**-0.5
    rope = config.rope
    if rope.rope_type != DEFAULT and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class DeepseekLayer(DecoderLayer):
    """One DeepSeek-V3 layer; the cache of a layer is ``k`` = latent, ``v`` = rotated key."""

    def __init__(self, config: MoEConfig, layer: int, w):
        super().__init__(config, layer, w)
        self.scale = softmax_scale(config)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, rope: Rotary) -> torch.Tensor:
        if self.config.mla.rope_interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return rope(x, positions)

    def attention(self, h: torch.Tensor, batch: ForwardBatch, rope: Rotary) -> torch.Tensor:
        c, m, w = self.config, self.config.mla, self.w
        x = rms_norm(h, w["input_layernorm.weight"], c.rms_norm_eps)
        t = x.shape[0]
        if m.q_lora_rank is None:
            q = F.linear(x, w["self_attn.q_proj.weight"])
        else:
            qa = F.linear(x, w["self_attn.q_a_proj.weight"], w.get("self_attn.q_a_proj.bias"))
            qa = rms_norm(qa, w["self_attn.q_a_layernorm.weight"], LORA_NORM_EPS)
            q = F.linear(qa, w["self_attn.q_b_proj.weight"])
        q = q.view(t, c.num_attention_heads, m.qk_head_dim)
        q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q_rot = self._rotate(q_rot, batch.positions, rope)
        kv = F.linear(
            x, w["self_attn.kv_a_proj_with_mqa.weight"], w.get("self_attn.kv_a_proj_with_mqa.bias")
        )
        latent, k_rot = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, w["self_attn.kv_a_layernorm.weight"], LORA_NORM_EPS)
        k_rot = self._rotate(k_rot[:, None], batch.positions, rope)[:, 0]
        out = q.new_empty(t, c.num_attention_heads, m.v_head_dim)
        for cache, start, n, past in zip(
            batch.caches, batch.starts, batch.num_new, batch.past, strict=True
        ):
            rows = slice(start, start + n)
            latents, keys = cache.layer(self.layer).append(latent[rows][None], k_rot[rows][None])
            out[rows] = self._attend_latent(q_nope[rows], q_rot[rows], latents[0], keys[0], past)
        return h + F.linear(
            out.reshape(t, -1), w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias")
        )

    def _attend_latent(self, q_nope, q_rot, latents, keys, past: int) -> torch.Tensor:
        """Queries ``[n, H, *]`` against the cached latents ``[L, r]`` and rotated keys
        ``[L, dr]``; query i sits at ``past + i``. Returns ``[n, H, v_head_dim]``."""
        c, m = self.config, self.config.mla
        n, length = q_nope.shape[0], latents.shape[0]
        kv = F.linear(latents, self.w["self_attn.kv_b_proj.weight"])
        kv = kv.view(length, c.num_attention_heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.float().split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        # [H, n, L]: the unrotated part per head, plus the rotated key every head shares.
        scores = torch.einsum("nhd,lhd->hnl", q_nope.float(), k_nope)
        scores = scores + torch.einsum("nhd,ld->hnl", q_rot.float(), keys.float())
        scores = scores * self.scale
        q_pos = torch.arange(past, past + n, device=latents.device)[:, None]
        future = torch.arange(length, device=latents.device)[None, :] > q_pos
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return torch.einsum("hnl,lhd->nhd", probs, v).to(q_nope.dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Group-limited sigmoid top-k; weights include ``routed_scaling_factor``."""
        c, m = self.config, self.config.mla
        # transformers scores in float32 whatever the model dtype.
        logits = F.linear(x.float(), self.w[self.router_name].float())
        scores = torch.sigmoid(logits)
        bias = self.w["mlp.gate.e_score_correction_bias"].float()
        choice = scores + bias
        t = choice.shape[0]
        grouped = choice.view(t, m.n_group, c.num_experts // m.n_group)
        group_scores = grouped.topk(GROUP_SCORE_TOP, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(m.topk_group, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool)
        allowed.scatter_(1, best_groups, True)
        allowed = allowed[:, :, None].expand_as(grouped).reshape(t, c.num_experts)
        choice = choice.masked_fill(~allowed, float("-inf"))
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
        return ids.to(torch.int32), weights * m.routed_scaling_factor

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.config.shared_expert_intermediate_size:
            return None
        p = "mlp.shared_experts."
        w = self.w
        return swiglu(
            x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"]
        )

    def finish(self, h: torch.Tensor, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        shared = self.shared(x)
        y = routed.to(h.dtype)
        return h + (y if shared is None else y + shared)

    def forward(
        self, h: torch.Tensor, batch: ForwardBatch, rope: Rotary, experts: ExpertsBackend | None
    ) -> torch.Tensor:
        if not self.sparse:
            return super().forward(h, batch, rope, experts)
        if experts is None:
            raise RuntimeError(f"layer {self.layer} is a MoE layer but the model has no experts")
        h = self.attention(h, batch, rope)
        x = self.mlp_input(h)
        ids, weights = self.route(x)
        pending = experts.dispatch(x, ids, weights, self.layer)
        shared = self.shared(x)  # overlaps the routed dispatch in flight
        y = experts.combine(pending).to(h.dtype)
        return h + (y if shared is None else y + shared)
