"""The reference MoE transformer (Mixtral / Qwen2-MoE / Qwen3-MoE / DeepSeek-V3), inference only.

A decoder layer is ``h += o_proj(attn(rope(q), rope(k), v))`` over the RMS-normed input, then
``h += moe(rms_norm(h))``. Attention is grouped-query with a per-sequence KV cache; the MoE block
routes every token to its top-k experts (softmax over all experts, top-k, optionally
renormalized) through an :class:`~moecomm_serving.model.experts.ExpertsBackend`, and adds the
Qwen2-MoE shared expert when the checkpoint has one; Qwen3-MoE RMS-normalizes each q/k head
before the rotation. Layers listed as dense in the config use a
plain SwiGLU MLP instead. DeepSeek-V3's layer (latent attention, grouped sigmoid router, shared
experts) subclasses :class:`~moecomm_serving.model.layer.DecoderLayer` in
:mod:`moecomm_serving.model.deepseek`.

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

from moecomm_serving.kv.blocks import DEFAULT_BLOCK_TOKENS, BlockPool, PagedSequence
from moecomm_serving.kv.cache import ForwardBatch, SequenceKV
from moecomm_serving.model.checkpoint import Checkpoint, global_names, layer_names
from moecomm_serving.model.config import MoEConfig
from moecomm_serving.model.deepseek import DeepseekLayer
from moecomm_serving.model.experts import ExpertsBackend, LocalExperts
from moecomm_serving.model.layer import DecoderLayer, linear, rms_norm
from moecomm_serving.model.rope import Rotary


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

    def new_sequence(self, pool: BlockPool | None = None) -> SequenceKV | PagedSequence:
        """An empty KV cache for one sequence over this model's layers: paged in `pool` (see
        :meth:`new_block_pool`), else one growable buffer per layer."""
        heads, k_dim, v_dim = self.kv_shape
        if pool is None:
            return SequenceKV(self.layers, heads, k_dim, self.dtype, self.device, v_dim)
        mine = (tuple(self.layers), self.kv_shape, self.dtype, self.device)
        theirs = (pool.layers, pool.kv_shape, pool.dtype, pool.device)
        if mine != theirs:
            raise ValueError(
                f"block pool (layers, kv shape, dtype, device) {theirs} does not fit this "
                f"model's {mine}"
            )
        return PagedSequence(pool)

    def new_block_pool(self, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> BlockPool:
        """A paged KV cache for this model's layers: blocks of `block_tokens` tokens."""
        heads, k_dim, v_dim = self.kv_shape
        return BlockPool(
            self.layers, heads, k_dim, v_dim, self.dtype, self.device, block_tokens=block_tokens
        )

    def prepare(
        self, caches: Sequence[SequenceKV | PagedSequence], num_new: Sequence[int]
    ) -> ForwardBatch:
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
        return linear(rms_norm(h, self.norm, self.config.rms_norm_eps), self.lm_head).float()

    # ------------------------------------------------------------------ whole model
    def forward(
        self,
        token_ids: Sequence[Sequence[int] | torch.Tensor],
        caches: Sequence[SequenceKV | PagedSequence],
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
            in-process (:class:`~moecomm_serving.model.experts.LocalExperts`); a backend object
            (e.g. a connected :class:`moecomm.runtime.AttentionClient`) to run them elsewhere, in
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
