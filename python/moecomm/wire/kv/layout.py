"""How a KV pool is laid out: its layers, each layer's parts (K and V, or one MLA latent) with
their block shapes and dtype, the bounds a layout read from a peer must respect, and block
index lists (checked, split into contiguous runs). Plain data, checked once: both ends of a
transfer compute everything else from a :class:`KvLayout`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from moecomm.errors import MoecommError

# Bounds on what a layout read from a peer may claim, checked before anything is allocated or
# attached: far above real models (DeepSeek-V3: 61 layers, one MLA part) yet small enough that a
# malformed description cannot ask for absurd memory.
MAX_LAYERS = 1024
MAX_PARTS_PER_LAYER = 8
MAX_BLOCKS = 1 << 24
MAX_BLOCK_BYTES = 1 << 30
MAX_DIMS = 8


DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
    )
}


class BlockTransferError(MoecommError, ValueError):
    """A KV transfer that cannot be done as asked: block indices out of range or duplicated,
    pools whose layouts do not match, a request for another pool or slot."""


@dataclass(frozen=True)
class KvPart:
    """One tensor of one layer: ``[num_blocks, *block_shape]`` of `dtype` (named e.g. "k")."""

    layer: int
    name: str
    block_shape: tuple[int, ...]
    dtype: str

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class KvLayout:
    """How a pool lays out its KV: `num_blocks` blocks, and per layer its parts. Two pools can
    exchange blocks when their layouts agree on everything but `num_blocks`."""

    num_layers: int
    num_blocks: int
    parts: tuple[KvPart, ...]

    @staticmethod
    def paged(
        num_layers: int,
        num_blocks: int,
        dtype: torch.dtype | str,
        parts: dict[str, Sequence[int]],
    ) -> KvLayout:
        """A layout with the same parts in every layer: ``parts={"k": (heads, block_tokens,
        k_dim), "v": (heads, block_tokens, v_dim)}`` (the reference serving's and vLLM's
        paged caches), or one part for an MLA latent."""
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        layout = KvLayout(
            int(num_layers),
            int(num_blocks),
            tuple(
                KvPart(layer, str(n), tuple(int(s) for s in shape), name)
                for layer in range(int(num_layers))
                for n, shape in parts.items()
            ),
        )
        layout.check()
        return layout

    def check(self) -> None:
        """Raises BlockTransferError naming the first field out of bounds."""
        if not 1 <= self.num_layers <= MAX_LAYERS:
            raise BlockTransferError(
                f"kv layout: num_layers {self.num_layers} not in [1, {MAX_LAYERS}]"
            )
        if not 1 <= self.num_blocks <= MAX_BLOCKS:
            raise BlockTransferError(
                f"kv layout: num_blocks {self.num_blocks} not in [1, {MAX_BLOCKS}]"
            )
        if not self.parts or len(self.parts) > self.num_layers * MAX_PARTS_PER_LAYER:
            raise BlockTransferError(
                f"kv layout: {len(self.parts)} parts for {self.num_layers} layers"
            )
        seen = set()
        for p in self.parts:
            if not 0 <= p.layer < self.num_layers:
                raise BlockTransferError(
                    f"kv layout: part {p.name!r} of layer {p.layer} is outside "
                    f"the {self.num_layers} layers"
                )
            if (p.layer, p.name) in seen:
                raise BlockTransferError(f"kv layout: layer {p.layer} has two parts {p.name!r}")
            seen.add((p.layer, p.name))
            if p.dtype not in DTYPES:
                raise BlockTransferError(
                    f"kv layout: unknown dtype {p.dtype!r} (known: {sorted(DTYPES)})"
                )
            if not 1 <= len(p.block_shape) <= MAX_DIMS or any(s < 1 for s in p.block_shape):
                raise BlockTransferError(
                    f"kv layout: bad block shape {list(p.block_shape)} of "
                    f"layer {p.layer} part {p.name!r}"
                )
            if p.block_bytes > MAX_BLOCK_BYTES:
                raise BlockTransferError(
                    f"kv layout: a block of layer {p.layer} part {p.name!r} "
                    f"holds {p.block_bytes} bytes (max {MAX_BLOCK_BYTES})"
                )
        if len({p.layer for p in self.parts}) != self.num_layers:
            raise BlockTransferError("kv layout: a layer has no part")

    def mismatch(self, other: KvLayout) -> str | None:
        """Why blocks cannot move between pools of `self` and `other` (None: they can)."""
        if self.num_layers != other.num_layers:
            return f"{self.num_layers} layers here, {other.num_layers} there"
        if len(self.parts) != len(other.parts):
            return f"{len(self.parts)} parts here, {len(other.parts)} there"
        for a, b in zip(self.parts, other.parts, strict=True):
            if a != b:
                return (
                    f"layer {a.layer} part {a.name!r} {list(a.block_shape)} {a.dtype} here, "
                    f"layer {b.layer} part {b.name!r} {list(b.block_shape)} {b.dtype} there"
                )
        return None

    def layer_parts(self, layer: int) -> list[int]:
        return [i for i, p in enumerate(self.parts) if p.layer == layer]

    @property
    def block_bytes(self) -> int:
        """The bytes of one block over every layer and part."""
        return sum(p.block_bytes for p in self.parts)

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "parts": [[p.layer, p.name, list(p.block_shape), p.dtype] for p in self.parts],
        }

    @staticmethod
    def from_dict(d: dict) -> KvLayout:
        """The layout a peer described, checked (BlockTransferError on anything malformed)."""
        try:
            parts = d["parts"]
            if not isinstance(parts, list) or len(parts) > MAX_LAYERS * MAX_PARTS_PER_LAYER:
                raise BlockTransferError("kv layout: parts must be a bounded list")
            layout = KvLayout(
                json_int(d["num_layers"]),
                json_int(d["num_blocks"]),
                tuple(
                    KvPart(
                        json_int(layer),
                        str(name)[:64],
                        tuple(json_int(s) for s in shape[: MAX_DIMS + 1]),
                        str(dtype)[:32],
                    )
                    for layer, name, shape, dtype in parts
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, BlockTransferError):
                raise
            raise BlockTransferError(f"kv layout: malformed description ({exc})") from None
        layout.check()
        return layout


def json_int(x) -> int:
    """`x` if it is a JSON integer (not a bool, not a float); else BlockTransferError."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise BlockTransferError(f"kv: expected an integer, got {x!r}")
    return x


def check_blocks(blocks: Iterable[int], num_blocks: int, what: str, unique: bool) -> list[int]:
    """`blocks` as a list of ints, each in [0, num_blocks) (and distinct when `unique`)."""
    out = [int(b) for b in blocks]
    for b in out:
        if not 0 <= b < num_blocks:
            raise BlockTransferError(f"{what} block {b} is out of range [0, {num_blocks})")
    if unique and len(set(out)) != len(out):
        dup = next(b for b in out if out.count(b) > 1)
        raise BlockTransferError(f"{what} block {dup} appears more than once")
    return out


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of each run where both sides are consecutive: one copy
    (one WRITE over a network) per run and part."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
