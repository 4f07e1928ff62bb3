"""The reference MoE transformer (Mixtral / Qwen2-MoE / Qwen3-MoE / DeepSeek-V3), inference only.

A decoder layer is ``h += o_proj(attn(rope(q), rope(k), v))`` over the RMS-normed input, then
``h += moe(rms_norm(h))``. Attention is grouped-query with a per-sequence KV cache; the MoE block
routes every token to its top-k experts (softmax over all experts, top-k, optionally
renormalized) through an :class:`~moecomm_serving.backends.ExpertsBackend`, and adds the
Qwen2-MoE shared expert when the checkpoint has one; Qwen3-MoE RMS-normalizes each q/k head
before the rotation. Layers listed as dense in the config use a
plain SwiGLU MLP instead. DeepSeek-V3's layer (latent attention, grouped sigmoid router, shared
experts) subclasses :class:`DecoderLayer` in :mod:`moecomm_serving.deepseek`.

All tokens of a forward are packed into ``[T, H]`` rows (no padding): projections, norms and the
MoE block see one matrix, exactly what is dispatched to expert servers; attention alone loops
over the sequences, each against its own cache. A model may own only a contiguous range of
layers (a pipeline stage): the stage that starts at layer 0 embeds tokens, the one that ends at
the last layer applies the final norm and the LM head.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from moecomm_serving.backends import ExpertsBackend, LocalExperts
from moecomm_serving.checkpoint import Checkpoint, expert_names, global_names, layer_names
from moecomm_serving.config import MoEConfig
from moecomm_serving.kvcache import ForwardBatch, SequenceKV
from moecomm_serving.rope import Rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalize in float32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    return _linear(F.silu(_linear(x, gate)) * _linear(x, up), down)


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
        q = _linear(x, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"))
        k = _linear(x, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias"))
        v = _linear(x, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias"))
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
        return h + _linear(out.reshape(t, -1), w["self_attn.o_proj.weight"], o_bias)

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
        logits = _linear(x, self.w[self.router_name])
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
            y = y + torch.sigmoid(_linear(x, w["mlp.shared_expert_gate.weight"])) * shared
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


class MoETransformer:
    """The model, or the contiguous range ``layers`` of it that one pipeline stage owns.

    Args:
        config: the checkpoint's config.
        tensors: HF-named tensors: those of :func:`stage_tensor_names` (extra names are an error).
        experts: where the MoE layers' routed experts run (needed when `layers` has MoE layers).
        layers: the layer range this model owns; all layers by default.
    """

    def __init__(
        self,
        config: MoEConfig,
        tensors: Mapping[str, torch.Tensor],
        experts: ExpertsBackend | None = None,
        layers: range | None = None,
    ):
        self.config = config
        self.layers = _check_range(config, layers)
        self.has_embed = self.layers.start == 0
        self.has_head = self.layers.stop == config.num_hidden_layers
        expected = stage_tensor_names(config, self.layers)
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        if missing or extra:
            raise ValueError(
                f"tensors for layers {self.layers.start}..{self.layers.stop - 1}: "
                f"missing {missing[:3]}, unexpected {extra[:3]}"
            )
        kinds = {(t.dtype, t.device) for t in tensors.values()}
        if len(kinds) != 1:
            raise ValueError(
                f"tensors mix dtypes/devices {sorted(map(str, kinds))}: load with one dtype="
            )
        self.dtype, self.device = kinds.pop()
        self.experts = experts
        self.rope = Rotary(config.head_dim, config.rope, self.device)
        self.blocks = []
        for i in self.layers:
            prefix = f"model.layers.{i}."
            own = {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}
            self.blocks.append(_layer_class(config)(config, i, own))
        self.embed_tokens = tensors.get("model.embed_tokens.weight")
        self.norm = tensors.get("model.norm.weight")
        self.lm_head = tensors.get("lm_head.weight", self.embed_tokens if self.has_head else None)
        if any(self.config.is_sparse(i) for i in self.layers) and experts is None:
            raise ValueError("the model's layers include MoE layers: pass an experts backend")

    def block(self, layer: int) -> DecoderLayer:
        """The decoder layer with global id `layer` (a stage's blocks start at its first)."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not in this model's layers {self.layers}")
        return self.blocks[layer - self.layers.start]

    # ------------------------------------------------------------------ caches and batches
    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """``(heads, key width, value width)`` of a layer's cache per token.

        DeepSeek's MLA caches one latent (``kv_lora_rank``) and one rotated key
        (``qk_rope_head_dim``) per token, in the key and value slots of a one-head cache.
        """
        c = self.config
        if c.mla is not None:
            return 1, c.mla.kv_lora_rank, c.mla.qk_rope_head_dim
        return c.num_key_value_heads, c.head_dim, c.head_dim

    def new_sequence(self) -> SequenceKV:
        """An empty KV cache for one sequence over this model's layers."""
        heads, k_dim, v_dim = self.kv_shape
        return SequenceKV(self.layers, heads, k_dim, self.dtype, self.device, v_dim)

    def prepare(self, caches: Sequence[SequenceKV], num_new: Sequence[int]) -> ForwardBatch:
        """The packed layout of a forward that adds `num_new[j]` tokens to sequence j."""
        batch = ForwardBatch.build(caches, num_new, self.device)
        top = max(p + n for p, n in zip(batch.past, batch.num_new, strict=True))
        if top > self.config.max_position_embeddings:
            raise ValueError(
                f"a sequence would reach {top} tokens, beyond max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
        return batch

    # ------------------------------------------------------------------ the three parts
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, H]`` hidden states (first stage only)."""
        if self.embed_tokens is None or not self.has_embed:
            raise RuntimeError("only the stage that owns layer 0 embeds tokens")
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device)
        v = self.config.vocab_size
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= v):
            raise ValueError(
                f"token ids must be in [0, {v}), got {token_ids.min()}..{token_ids.max()}"
            )
        return F.embedding(token_ids, self.embed_tokens)

    def forward_hidden(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Runs this model's layers over packed hidden states ``[T, H]``, filling the caches."""
        if h.shape != (batch.num_tokens, self.config.hidden_size):
            raise ValueError(
                f"hidden states must be [{batch.num_tokens}, {self.config.hidden_size}], "
                f"got {list(h.shape)}"
            )
        try:
            for block in self.blocks:
                h = block.forward(h, batch, self.rope, self.experts)
        except BaseException:
            # A failed step (an expert server lost mid-layer, say) must not leave some layers
            # holding the step's keys and others not: roll every cache back, so the caller can
            # simply retry the same step.
            for cache, past in zip(batch.caches, batch.past, strict=True):
                for i in self.layers:
                    kv = cache.layer(i)
                    kv.truncate(min(kv.length, past))
            raise
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (last stage only): ``[N, H]`` -> float32 ``[N, vocab]``."""
        if not self.has_head:
            raise RuntimeError("only the stage that owns the last layer computes logits")
        return _linear(rms_norm(h, self.norm, self.config.rms_norm_eps), self.lm_head).float()

    # ------------------------------------------------------------------ whole model
    def forward(
        self,
        token_ids: Sequence[Sequence[int] | torch.Tensor],
        caches: Sequence[SequenceKV],
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Appends ``token_ids[j]`` to sequence j and returns logits.

        Returns ``[B, vocab]`` float32 logits of each sequence's last new token, or with
        `all_logits` the ``[T, vocab]`` logits of every new token, packed in batch order.
        """
        if not (self.has_embed and self.has_head):
            raise RuntimeError("forward needs the whole model; a stage uses forward_hidden")
        ids = [torch.as_tensor(t, dtype=torch.int64).reshape(-1) for t in token_ids]
        batch = self.prepare(caches, [int(t.numel()) for t in ids])
        h = self.forward_hidden(self.embed(torch.cat(ids)), batch)
        if not all_logits:
            h = h.index_select(0, batch.last_rows())
        return self.logits(h)


def _layer_class(config: MoEConfig) -> type[DecoderLayer]:
    if config.mla is None:
        return DecoderLayer
    from moecomm_serving.deepseek import DeepseekLayer  # imports this module: import here

    return DeepseekLayer


def stage_tensor_names(config: MoEConfig, layers: range) -> list[str]:
    """HF names of the non-expert tensors a model owning `layers` needs."""
    layers = _check_range(config, layers)
    names = list(
        global_names(config, embed=layers.start == 0, head=layers.stop == config.num_hidden_layers)
    )
    for i in layers:
        names.extend(layer_names(config, i))
    return names


def _check_range(config: MoEConfig, layers: range | None) -> range:
    n = config.num_hidden_layers
    if layers is None:
        return range(n)
    if (
        not isinstance(layers, range)
        or layers.step != 1
        or not 0 <= layers.start < layers.stop <= n
    ):
        raise ValueError(
            f"layers must be a non-empty contiguous range within [0, {n}), got {layers}"
        )
    return layers


LOCAL = "local"


def load_model(
    path,
    experts: ExpertsBackend | str | None = LOCAL,
    layers: range | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> MoETransformer:
    """Loads a HF-layout checkpoint directory (or the layer range of one pipeline stage).

    Args:
        path: directory with ``config.json`` and ``*.safetensors``.
        experts: ``"local"`` to load the routed experts of the owned MoE layers and run them
            in-process (:class:`~moecomm_serving.backends.LocalExperts`); a backend object (e.g.
            a connected :class:`moecomm.runtime.AttentionClient`) to run them elsewhere, in
            which case no expert weight is read; ``None`` only when the range has no MoE layer.
        layers: contiguous range of layers to own; all by default.
        dtype: cast every tensor to this dtype; the stored dtype by default.
    """
    ckpt = Checkpoint(path)
    config = ckpt.config
    layers = _check_range(config, layers)
    tensors = ckpt.read(stage_tensor_names(config, layers), dtype, device)
    if isinstance(experts, str):
        if experts != LOCAL:
            raise ValueError(f"experts must be {LOCAL!r}, a backend or None, got {experts!r}")
        hosted = {i: range(config.num_experts) for i in layers if config.is_sparse(i)}
        experts = LocalExperts(ckpt.read_experts(hosted, dtype, device)) if hosted else None
    return MoETransformer(config, tensors, experts, layers)
