"""The paged KV cache: fixed-size blocks in one pool per model, a block table per sequence.

A :class:`BlockPool` holds, for every layer the model owns, a key tensor
``[capacity, heads, block_tokens, key width]`` and a value tensor of the same shape with the
value width (DeepSeek's MLA: the latent in the key slot, the rotated key in the value slot, one
"head", as :class:`~moecomm_serving.kv.cache.LayerKV` lays them out). One block id names the same
token range in every layer, so a block is the unit the prefix cache shares
(:mod:`moecomm_serving.kv.prefix_cache`) and the unit a request's cache is exported in
(:meth:`PagedSequence.export_blocks`, for a later prefill -> decode hand-off).

A :class:`PagedSequence` is a drop-in for :class:`~moecomm_serving.kv.cache.SequenceKV` in
:meth:`MoETransformer.forward <moecomm_serving.model.transformer.MoETransformer.forward>`:
``layer(i)`` returns a view whose ``append`` writes the new keys into the sequence's blocks and
returns the whole cache gathered in token order, ``[heads, length, width]``, the exact values the
growable cache returns, so the attention arithmetic (and so every output) is bit-identical.

Blocks are reference counted: a sequence holds one reference per block of its table, the prefix
cache one per block it keeps. A block with more than one reference is never written: a sequence
about to write into one copies it first (copy on write), so sharing is invisible to the math.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from moecomm_serving.types import KvPackage

# Tokens per block by default: small enough that a prefix is reused at a fine grain, large
# enough that the block table and the per-block bookkeeping stay small (vLLM's default too).
DEFAULT_BLOCK_TOKENS = 16
# Blocks allocated per layer when a pool is created (256 tokens at the default block size: a
# real checkpoint's pool starts at tens of MB, not at its peak); the pool then doubles when it
# runs out, so a pool that ends up with n blocks was copied O(log n) times. It never shrinks:
# its high-water mark stays allocated, as a preallocated serving cache would be.
INITIAL_POOL_BLOCKS = 16
# Format tag of an exported sequence (a bump means a receiver must refuse older packages).
EXPORT_VERSION = 1


class BlockPool:
    """Fixed-size KV blocks for the layers `layers`, reference counted.

    Args:
        layers: global ids of the layers cached (a pipeline stage's range, or all).
        kv_heads, k_dim, v_dim: per token per layer: heads, key width, value width.
        block_tokens: tokens per block.
        initial_blocks: blocks allocated up front (the pool grows by doubling).
    """

    def __init__(
        self,
        layers: Iterable[int],
        kv_heads: int,
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype,
        device,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        initial_blocks: int = INITIAL_POOL_BLOCKS,
    ):
        self.layers = tuple(int(i) for i in layers)
        if not self.layers:
            raise ValueError("a block pool needs at least one layer")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers repeat: {self.layers}")
        if block_tokens < 1 or initial_blocks < 1:
            raise ValueError(
                f"block_tokens and initial_blocks must be >= 1, got {block_tokens}, "
                f"{initial_blocks}"
            )
        if min(kv_heads, k_dim, v_dim) < 1:
            raise ValueError(f"kv shape must be positive, got {(kv_heads, k_dim, v_dim)}")
        self.block_tokens = int(block_tokens)
        self.kv_shape = (int(kv_heads), int(k_dim), int(v_dim))
        self.dtype, self.device = dtype, torch.device(device)
        b = self.block_tokens
        self.k = {
            i: torch.zeros(initial_blocks, kv_heads, b, k_dim, dtype=dtype, device=self.device)
            for i in self.layers
        }
        self.v = {
            i: torch.zeros(initial_blocks, kv_heads, b, v_dim, dtype=dtype, device=self.device)
            for i in self.layers
        }
        self.refs = [0] * initial_blocks
        # Lowest ids first: a fresh pool hands out 0, 1, 2... (deterministic block tables).
        self._free = list(range(initial_blocks - 1, -1, -1))

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        return len(self.refs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer, keys and values."""
        heads, kd, vd = self.kv_shape
        elem = torch.empty((), dtype=self.dtype).element_size()
        return len(self.layers) * heads * self.block_tokens * (kd + vd) * elem

    # ------------------------------------------------------------------ allocation
    def allocate(self) -> int:
        """A free block with one reference (the caller's)."""
        if not self._free:
            self._grow()
        block = self._free.pop()
        self.refs[block] = 1
        return block

    def ref(self, block: int) -> None:
        self._check_live(block)
        self.refs[block] += 1

    def unref(self, block: int) -> None:
        self._check_live(block)
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        if not 0 <= block < self.capacity:
            raise ValueError(f"block {block} outside the pool [0, {self.capacity})")
        return self.refs[block]

    def _check_live(self, block: int) -> None:
        if self.refcount(block) < 1:
            raise RuntimeError(f"block {block} is free: a reference was dropped twice")

    def _grow(self) -> None:
        old = self.capacity
        for store in (self.k, self.v):
            for i, t in store.items():
                grown = t.new_zeros(2 * old, *t.shape[1:])
                grown[:old] = t
                store[i] = grown
        self.refs += [0] * old
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free

    def copy_block(self, src: int, dst: int) -> None:
        """Copies every layer's keys and values of `src` into `dst` (copy on write)."""
        for store in (self.k, self.v):
            for t in store.values():
                t[dst] = t[src]

    # ------------------------------------------------------------------ helpers
    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` tokens."""
        return -(-int(tokens) // self.block_tokens)


class PagedLayerView:
    """One layer of a :class:`PagedSequence`, with the :class:`~moecomm_serving.kv.cache.LayerKV`
    interface the attention code uses (``append``, ``truncate``, ``length``)."""

    def __init__(self, seq: PagedSequence, layer: int):
        self.seq, self.layer = seq, layer

    @property
    def length(self) -> int:
        return self.seq.lengths[self.layer]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends ``[kv_heads, n, width]`` keys/values; returns the whole cache, gathered."""
        return self.seq.append(self.layer, k, v)

    def truncate(self, length: int) -> None:
        self.seq.truncate_layer(self.layer, length)

    @property
    def k(self) -> torch.Tensor:
        """The cached keys ``[heads, length, width]`` (a gathered copy, read-only use)."""
        return self.seq.gather(self.layer)[0]

    @property
    def v(self) -> torch.Tensor:
        return self.seq.gather(self.layer)[1]


class PagedSequence:
    """One sequence's cache: a block table into `pool` and a length per layer."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.table: list[int] = []
        self.lengths = dict.fromkeys(pool.layers, 0)
        self.released = False

    # ------------------------------------------------------------------ SequenceKV interface
    @property
    def layers(self) -> tuple[int, ...]:
        return self.pool.layers

    @property
    def length(self) -> int:
        """Tokens cached; equal across layers between forwards."""
        lengths = set(self.lengths.values())
        if len(lengths) != 1:
            raise RuntimeError(f"layers of one sequence disagree on its length: {lengths}")
        return lengths.pop()

    def layer(self, layer: int) -> PagedLayerView:
        if layer not in self.lengths:
            raise KeyError(
                f"this sequence cache holds layers {list(self.pool.layers)}, not layer {layer}"
            )
        self._check_open()
        return PagedLayerView(self, layer)

    def truncate(self, length: int) -> None:
        for i in self.lengths:
            self.truncate_layer(i, length)

    # ------------------------------------------------------------------ paged operations
    def _check_open(self) -> None:
        if self.released:
            raise RuntimeError("this sequence's blocks were released")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self._check_open()
        heads, kd, vd = self.pool.kv_shape
        n = k.shape[1] if k.dim() == 3 else -1
        if k.shape != (heads, n, kd) or v.shape != (heads, n, vd) or n < 0:
            raise ValueError(
                f"append wants keys [{heads}, n, {kd}] and values [{heads}, n, {vd}], got "
                f"{list(k.shape)} and {list(v.shape)}"
            )
        start = self.lengths[layer]
        need = start + n
        self._cover(need)
        b = self.pool.block_tokens
        pos = start
        while pos < need:
            j, off = divmod(pos, b)
            cnt = min(b - off, need - pos)
            block = self._writable(j)
            src = slice(pos - start, pos - start + cnt)
            self.pool.k[layer][block, :, off : off + cnt] = k[:, src]
            self.pool.v[layer][block, :, off : off + cnt] = v[:, src]
            pos += cnt
        self.lengths[layer] = need
        return self.gather(layer)

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cache in token order: ``[heads, length, width]`` keys and values."""
        self._check_open()
        length = self.lengths[layer]
        nb = self.pool.blocks_for(length)
        idx = torch.tensor(self.table[:nb], dtype=torch.int64, device=self.pool.device)
        out = []
        for store in (self.pool.k, self.pool.v):
            blocks = store[layer].index_select(0, idx)  # [nb, heads, B, width]
            heads, width = blocks.shape[1], blocks.shape[3]
            whole = blocks.transpose(0, 1).reshape(heads, nb * self.pool.block_tokens, width)
            out.append(whole[:, :length])
        return out[0], out[1]

    def _cover(self, tokens: int) -> None:
        """Grows the table so it holds `tokens` tokens (shared by every layer)."""
        while len(self.table) < self.pool.blocks_for(tokens):
            self.table.append(self.pool.allocate())

    def _writable(self, j: int) -> int:
        """Block j of the table, copied first if anyone else holds it (copy on write)."""
        block = self.table[j]
        if self.pool.refcount(block) > 1:
            fresh = self.pool.allocate()
            self.pool.copy_block(block, fresh)
            self.pool.unref(block)
            self.table[j] = fresh
            block = fresh
        return block

    def truncate_layer(self, layer: int, length: int) -> None:
        """Forgets tokens from `length` on in one layer; blocks no layer needs are dropped."""
        self._check_open()
        if not 0 <= length <= self.lengths[layer]:
            raise ValueError(f"truncate: length {length} outside [0, {self.lengths[layer]}]")
        self.lengths[layer] = length
        keep = self.pool.blocks_for(max(self.lengths.values()))
        while len(self.table) > keep:
            self.pool.unref(self.table.pop())

    def adopt(self, blocks: list[int], tokens: int) -> None:
        """Starts an empty sequence from full blocks the caller already holds references to
        (a prefix-cache hit): their references pass to this sequence."""
        self._check_open()
        if self.table or any(self.lengths.values()):
            raise RuntimeError("only an empty sequence can adopt cached blocks")
        if tokens != len(blocks) * self.pool.block_tokens:
            raise ValueError(f"{len(blocks)} full blocks hold {tokens} tokens? they do not")
        self.table = list(blocks)
        for i in self.lengths:
            self.lengths[i] = tokens

    def release(self) -> None:
        """Drops this sequence's references (idempotent); blocks the prefix cache keeps stay."""
        if self.released:
            return
        for block in self.table:
            self.pool.unref(block)
        self.table = []
        self.released = True

    # ------------------------------------------------------------------ hand-off
    def export_blocks(self) -> KvPackage:
        """The cache as plain data another front end can import (:meth:`import_blocks`); a
        router hands it (as bytes over a moecomm transport,
        :func:`~moecomm_serving.kv.package.encode_package`) from a prefill front end to a decode
        front end."""
        length = self.length
        nb = self.pool.blocks_for(length)
        idx = torch.tensor(self.table[:nb], dtype=torch.int64, device=self.pool.device)
        layers = self.pool.layers
        return KvPackage(
            version=EXPORT_VERSION,
            length=length,
            block_tokens=self.pool.block_tokens,
            layers=tuple(layers),
            kv_shape=tuple(self.pool.kv_shape),
            dtype=dtype_name(self.pool.dtype),
            k=torch.stack([self.pool.k[i].index_select(0, idx) for i in layers]).cpu(),
            v=torch.stack([self.pool.v[i].index_select(0, idx) for i in layers]).cpu(),
        )

    @classmethod
    def import_blocks(cls, pool: BlockPool, package: KvPackage | CheckedKvPackage) -> PagedSequence:
        """A new sequence in `pool` holding an :meth:`export_blocks` package; a package that
        does not fit this pool (other model, block size, dtype, layers) is refused. A
        :class:`CheckedKvPackage` of this pool was checked already and is not checked again."""
        if not (isinstance(package, CheckedKvPackage) and package.pool is pool):
            package = check_package(pool, package)
        package = package.package
        seq = cls(pool)
        k, v = package.k, package.v
        for j in range(k.shape[1]):
            block = pool.allocate()
            seq.table.append(block)
            for li, layer in enumerate(pool.layers):
                pool.k[layer][block] = k[li, j].to(pool.device)
                pool.v[layer][block] = v[li, j].to(pool.device)
        for i in seq.lengths:
            seq.lengths[i] = package.length
        return seq


def dtype_name(dtype: torch.dtype) -> str:
    """A KV package's name of an element type (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


# Only check_package makes a CheckedKvPackage: the token it passes says the check ran.
_BY_THE_CHECK = object()


@dataclass(frozen=True, eq=False)
class CheckedKvPackage:
    """A :class:`~moecomm_serving.types.KvPackage` that :func:`check_package` found to fit
    `pool`: :meth:`PagedSequence.import_blocks` into that pool takes it without checking it
    again, so a package handed from a route to the engine is checked exactly once."""

    package: KvPackage
    pool: BlockPool
    by: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.by is not _BY_THE_CHECK:
            raise TypeError("a CheckedKvPackage is made by check_package only")

    @property
    def length(self) -> int:
        return self.package.length


def check_package(pool: BlockPool, p: KvPackage | CheckedKvPackage) -> CheckedKvPackage:
    """`p` as a :class:`CheckedKvPackage` of `pool`; raises ValueError unless `p` is a
    :class:`~moecomm_serving.types.KvPackage` that fits `pool` (version, block size, layers, KV
    shape, dtype, tensor shapes for its length). A package already checked for `pool` is
    returned as it is."""
    if isinstance(p, CheckedKvPackage):
        if p.pool is pool:
            return p
        p = p.package  # checked against another pool: this one asks its own question
    if not isinstance(p, KvPackage):
        raise ValueError(f"a KV package is a KvPackage, got {type(p).__name__}")
    if p.version != EXPORT_VERSION:
        raise ValueError(f"KV package version {p.version!r}, this build reads {EXPORT_VERSION}")
    mine = {
        "block_tokens": pool.block_tokens,
        "layers": tuple(pool.layers),
        "kv_shape": tuple(pool.kv_shape),
        "dtype": dtype_name(pool.dtype),
    }
    for key, want in mine.items():
        got = getattr(p, key)
        if (tuple(got) if isinstance(got, list) else got) != want:
            raise ValueError(f"KV package {key} is {got!r}, this pool's is {want!r}")
    length = p.length
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise ValueError(f"KV package length must be an int >= 0, got {length!r}")
    nb = pool.blocks_for(length)
    heads, kd, vd = pool.kv_shape
    shapes = {
        "k": (len(pool.layers), nb, heads, pool.block_tokens, kd),
        "v": (len(pool.layers), nb, heads, pool.block_tokens, vd),
    }
    for key, shape in shapes.items():
        t = getattr(p, key)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != pool.dtype:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"KV package {key} must be a {pool.dtype} tensor of shape {shape} for "
                f"{length} tokens, got {got}"
            )
    return CheckedKvPackage(p, pool, _BY_THE_CHECK)
