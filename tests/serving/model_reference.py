"""An independent, plain reference of the model: whole sequences, no cache, no packing, keys and
values repeated per query head, RoPE as an explicit 2-D rotation of each (i, i + D/2) pair, and
the MoE block as a loop over tokens and their chosen experts."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from moecomm_serving.model.checkpoint import expert_names
from moecomm_serving.model.config import MoEConfig


def norm(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    """x [T, heads, D]: pair (i, i + D/2) turned by angle pos · theta^(-2i/D)."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        ang = positions.double() * theta ** (-2.0 * i / d)
        c, s = ang.cos().float()[:, None], ang.sin().float()[:, None]
        a, b = x[..., i], x[..., i + d // 2]
        out[..., i] = a * c - b * s
        out[..., i + d // 2] = a * s + b * c
    return out


def mlp(x, t, prefix):
    g, u, d = (t[f"{prefix}.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
    return F.silu(x @ g.T) * (x @ u.T) @ d.T


def moe(cfg: MoEConfig, t, layer, x):
    names = expert_names(cfg)
    logits = x @ t[names.router(layer)].T
    probs = torch.softmax(logits, -1)
    y = torch.zeros_like(x)
    for r in range(x.shape[0]):
        top = torch.argsort(probs[r], descending=True)[: cfg.num_experts_per_tok]
        w = probs[r, top]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        for e, we in zip(top.tolist(), w, strict=True):
            n = names.expert(layer, e)
            h = F.silu(t[n["w1"]] @ x[r]) * (t[n["w3"]] @ x[r])
            y[r] += we * (t[n["w2"]] @ h)
    p = f"model.layers.{layer}.mlp"
    if cfg.shared_expert_intermediate_size:
        gate = torch.sigmoid(x @ t[f"{p}.shared_expert_gate.weight"].T)
        y = y + gate * mlp(x, t, f"{p}.shared_expert")
    return y


def forward(cfg: MoEConfig, t: dict, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one whole sequence."""
    n, d = len(ids), cfg.head_dim
    pos = torch.arange(n)
    h = t["model.embed_tokens.weight"][torch.tensor(ids)]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        x = norm(h, t[f"{p}.input_layernorm.weight"], cfg.rms_norm_eps)

        def proj(name, heads, x=x, p=p):
            y = x @ t[f"{p}.self_attn.{name}.weight"].T
            if cfg.attention_bias:
                y = y + t[f"{p}.self_attn.{name}.bias"]
            return y.view(n, heads, d)

        q = rope(proj("q_proj", cfg.num_attention_heads), pos, cfg.rope.theta)
        k = rope(proj("k_proj", cfg.num_key_value_heads), pos, cfg.rope.theta)
        v = proj("v_proj", cfg.num_key_value_heads)
        k = k.repeat_interleave(cfg.num_kv_groups, dim=1)
        v = v.repeat_interleave(cfg.num_kv_groups, dim=1)
        att = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        att = torch.softmax(att.masked_fill(~causal, float("-inf")), -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, -1)
        h = h + o @ t[f"{p}.self_attn.o_proj.weight"].T
        x = norm(h, t[f"{p}.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        h = h + (moe(cfg, t, i, x) if cfg.is_sparse(i) else mlp(x, t, f"{p}.mlp"))
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return norm(h, t["model.norm.weight"], cfg.rms_norm_eps) @ head.T
