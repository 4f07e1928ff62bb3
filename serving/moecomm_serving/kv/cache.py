"""The KV cache: one growable key/value buffer per (sequence, layer).

A :class:`SequenceKV` holds the cache of one sequence for the layers a model (or pipeline stage)
owns, keyed by global layer id, so a stage that hands layers to another can move exactly those
entries (:meth:`SequenceKV.pop_layer` / :meth:`SequenceKV.put_layer`). Sequences of a batch are
independent objects of independent lengths: a batch of decode steps, a batch of prefills of
different lengths, or a mix, all go through one forward (see :class:`ForwardBatch`).

The serving engine caches in fixed-size blocks instead (:mod:`moecomm_serving.kv.blocks`, with
the prefix cache of :mod:`moecomm_serving.kv.prefix_cache` on top); its
:class:`~moecomm_serving.kv.blocks.PagedSequence` has this module's interface (``layer(i)``
with ``append`` / ``truncate`` / ``length``), so a forward takes either, and returns the same
bytes with either. This growable cache stays the default of ``MoETransformer.new_sequence()``
and what pipeline stages use (they move one layer's cache between processes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# First allocation per (sequence, layer), in tokens: enough for a short prompt; the buffer then
# doubles, so a sequence of n tokens costs O(log n) reallocations.
INITIAL_CAPACITY = 64


class LayerKV:
    """Keys and values of one layer of one sequence: ``[kv_heads, capacity, head_dim]`` each.

    `v_dim` gives the values another width: DeepSeek's MLA caches its compressed latent in
    ``k`` and its rotated key in ``v`` (one "head" of each, see
    :mod:`moecomm_serving.model.deepseek`).
    """

    def __init__(
        self, kv_heads: int, head_dim: int, dtype: torch.dtype, device, v_dim: int | None = None
    ):
        self.k = torch.empty(kv_heads, INITIAL_CAPACITY, head_dim, dtype=dtype, device=device)
        self.v = torch.empty(
            kv_heads, INITIAL_CAPACITY, v_dim or head_dim, dtype=dtype, device=device
        )
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends ``[kv_heads, n, head_dim]`` keys/values; returns views of the whole cache."""
        n = k.shape[1]
        need = self.length + n
        if need > self.k.shape[1]:
            cap = self.k.shape[1]
            while cap < need:
                cap *= 2
            grown_k = self.k.new_empty(self.k.shape[0], cap, self.k.shape[2])
            grown_v = self.v.new_empty(self.v.shape[0], cap, self.v.shape[2])
            grown_k[:, : self.length] = self.k[:, : self.length]
            grown_v[:, : self.length] = self.v[:, : self.length]
            self.k, self.v = grown_k, grown_v
        self.k[:, self.length : need] = k
        self.v[:, self.length : need] = v
        self.length = need
        return self.k[:, :need], self.v[:, :need]

    def truncate(self, length: int) -> None:
        """Forgets tokens from `length` on (e.g. to re-run a step)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate: length {length} outside [0, {self.length}]")
        self.length = length


class SequenceKV:
    """One sequence's KV cache over a set of layers."""

    def __init__(
        self,
        layers: Iterable[int],
        kv_heads: int,
        head_dim: int,
        dtype,
        device,
        v_dim: int | None = None,
    ):
        self.layers = {int(i): LayerKV(kv_heads, head_dim, dtype, device, v_dim) for i in layers}
        if not self.layers:
            raise ValueError("a sequence cache needs at least one layer")

    @property
    def length(self) -> int:
        """Tokens cached; equal across layers between forwards."""
        lengths = {kv.length for kv in self.layers.values()}
        if len(lengths) != 1:
            raise RuntimeError(f"layers of one sequence disagree on its length: {lengths}")
        return lengths.pop()

    def layer(self, layer: int) -> LayerKV:
        try:
            return self.layers[layer]
        except KeyError:
            raise KeyError(
                f"this sequence cache holds layers {sorted(self.layers)}, not layer {layer}"
            ) from None

    def pop_layer(self, layer: int) -> LayerKV:
        """Removes and returns one layer's cache (to migrate it to another pipeline stage)."""
        kv = self.layer(layer)
        del self.layers[layer]
        return kv

    def put_layer(self, layer: int, kv: LayerKV) -> None:
        if layer in self.layers:
            raise ValueError(f"layer {layer} is already cached here")
        self.layers[int(layer)] = kv

    def truncate(self, length: int) -> None:
        for kv in self.layers.values():
            kv.truncate(length)


@dataclass
class ForwardBatch:
    """Sequences of one forward and where their new tokens sit in the packed ``[T, ...]`` rows.

    Sequence j contributes rows ``starts[j] : starts[j] + num_new[j]``, at positions
    ``past[j] ... past[j] + num_new[j] - 1``.
    """

    caches: list  # SequenceKV or kv_blocks.PagedSequence: anything with length and layer(i)
    num_new: list[int]
    past: list[int]
    starts: list[int]
    positions: torch.Tensor  # [T] int64

    @classmethod
    def build(cls, caches: Sequence, num_new: Sequence[int], device) -> ForwardBatch:
        if len(caches) != len(num_new):
            raise ValueError(f"{len(caches)} caches but {len(num_new)} token counts")
        if not caches:
            raise ValueError("a forward needs at least one sequence")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("the same sequence cache appears twice in one batch")
        if any(int(n) <= 0 for n in num_new):
            raise ValueError(f"every sequence needs at least one new token, got {list(num_new)}")
        past = [c.length for c in caches]
        starts, pos, t = [], [], 0
        for p, n in zip(past, num_new, strict=True):
            starts.append(t)
            pos.append(torch.arange(p, p + n, dtype=torch.int64))
            t += n
        positions = torch.cat(pos).to(device)
        return cls(list(caches), [int(n) for n in num_new], past, starts, positions)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def last_rows(self) -> torch.Tensor:
        """Row index of every sequence's last new token (the one whose logits pick the next)."""
        return torch.tensor(
            [s + n - 1 for s, n in zip(self.starts, self.num_new, strict=True)],
            dtype=torch.int64,
            device=self.positions.device,
        )
