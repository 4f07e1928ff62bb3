"""The paged KV cache: fixed-size blocks in one pool per model, a block table per sequence.

A :class:`BlockPool` holds, for every layer the model owns, a key tensor
``[capacity, heads, block_tokens, key width]`` and a value tensor of the same shape with the
value width (DeepSeek's MLA: the latent in the key slot, the rotated key in the value slot, one
"head", as :class:`~moecomm_serving.kv.cache.LayerKV` lays them out). One block id names the same
token range in every layer, so a block is the unit the prefix cache shares
(:mod:`moecomm_serving.kv.prefix_cache`) and the unit a request's cache is handed off in: a
prefill front end holds its request's blocks (:meth:`PagedSequence.export_blocks`, a
:class:`HeldBlocks`), a decode front end reserves blocks for them (:meth:`HeldBlocks.reserve`),
the bytes move block to block between the two pools (:mod:`moecomm.wire.kv`, when the pools'
tensors live in a :class:`moecomm.wire.kv.KvPool`, :meth:`BlockPool.place`), and the decode's
sequence adopts the reserved blocks (:meth:`PagedSequence.import_blocks`): no copy here.

A :class:`PagedSequence` is a drop-in for :class:`~moecomm_serving.kv.cache.SequenceKV` in
:meth:`MoETransformer.forward <moecomm_serving.model.transformer.MoETransformer.forward>`:
``layer(i)`` returns a view whose ``append`` writes the new keys into the sequence's blocks and
returns the whole cache gathered in token order, ``[heads, length, width]``, the exact values the
growable cache returns, so the attention arithmetic (and so every output) is bit-identical.

Blocks are reference counted: a sequence holds one reference per block of its table, the prefix
cache one per block it keeps, a hand-off one per block it holds. A block with more than one
reference is never written: a sequence about to write into one copies it first (copy on write),
so sharing is invisible to the math, and a block being sent is never overwritten. The engine
thread runs the model; the counts are also changed by the threads that hand KV off (a reserve,
a release), so they are kept under the pool's lock.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch
from moecomm.errors import MoecommError

from moecomm_serving.types import KvPackage

# Tokens per block by default: small enough that a prefix is reused at a fine grain, large
# enough that the block table and the per-block bookkeeping stay small (vLLM's default too).
DEFAULT_BLOCK_TOKENS = 16
# Blocks allocated per layer when a pool is created (256 tokens at the default block size: a
# real checkpoint's pool starts at tens of MB, not at its peak); the pool then doubles when it
# runs out, so a pool that ends up with n blocks was copied O(log n) times. It never shrinks:
# its high-water mark stays allocated, as a preallocated serving cache would be.
INITIAL_POOL_BLOCKS = 16
# Format tag of a handed-off cache's metadata (a bump means a receiver must refuse older ones).
# 2: the blocks move pool to pool (1 was a byte package with the tensors inside).
EXPORT_VERSION = 2


class KvPoolFullError(MoecommError, RuntimeError):
    """A pool of fixed capacity (:meth:`BlockPool.place`) has no free block left."""


class BlockPool:
    """Fixed-size KV blocks for the layers `layers`, reference counted.

    Args:
        layers: global ids of the layers cached (a pipeline stage's range, or all).
        kv_heads, k_dim, v_dim: per token per layer: heads, key width, value width.
        block_tokens: tokens per block.
        initial_blocks: blocks allocated up front (the pool grows by doubling, until it is
            placed in memory of a fixed size: :meth:`place`).
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
        self.growable = True
        # Reentrant: allocate() grows under it.
        self._lock = threading.RLock()

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
        with self._lock:
            if not self._free:
                self._grow()
            block = self._free.pop()
            self.refs[block] = 1
            return block

    def allocate_many(self, n: int) -> list[int]:
        """`n` free blocks, one reference each, all or none (KvPoolFullError)."""
        with self._lock:
            while self.growable and len(self._free) < n:
                self._grow()
            if len(self._free) < n:
                raise KvPoolFullError(
                    f"KV pool full: {n} blocks wanted, {len(self._free)} of {self.capacity} free"
                )
            return [self.allocate() for _ in range(n)]

    def ref(self, block: int) -> None:
        with self._lock:
            self._check_live(block)
            self.refs[block] += 1

    def unref(self, block: int) -> None:
        with self._lock:
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

    def place(self, k: dict[int, torch.Tensor], v: dict[int, torch.Tensor]) -> None:
        """Moves the pool's storage into `k` and `v` (per layer, ``[capacity, heads,
        block_tokens, width]``: the views of a :class:`moecomm.wire.kv.KvPool`, which peers
        write blocks into). The pool keeps that capacity from then on (a full pool raises
        KvPoolFullError instead of growing: a peer's writes must land where it was told).
        Only a pool with no block in use can be placed (a front end does it before it serves)."""
        with self._lock:
            if self.num_used:
                raise RuntimeError(f"a pool with {self.num_used} blocks in use cannot be placed")
            if set(k) != set(self.layers) or set(v) != set(self.layers):
                raise ValueError(
                    f"place: tensors for layers {sorted(k)}, the pool has {self.layers}"
                )
            capacity = k[self.layers[0]].shape[0]
            heads, kd, vd = self.kv_shape
            b = self.block_tokens
            for store, width in ((k, kd), (v, vd)):
                for t in store.values():
                    if tuple(t.shape) != (capacity, heads, b, width) or t.dtype != self.dtype:
                        raise ValueError(
                            f"place: a layer's tensor is {t.dtype} {list(t.shape)}, the pool "
                            f"needs {self.dtype} {[capacity, heads, b, width]}"
                        )
            self.k, self.v = dict(k), dict(v)
            self.refs = [0] * capacity
            self._free = list(range(capacity - 1, -1, -1))
            self.growable = False

    def _grow(self) -> None:
        if not self.growable:
            raise KvPoolFullError(f"KV pool full: all {self.capacity} blocks in use")
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
    def export_blocks(self) -> HeldBlocks:
        """The sequence's blocks held for a hand-off (one more reference each, so releasing the
        sequence does not free them; nobody writes them while they are held), with their
        metadata; the caller sends them (:mod:`moecomm.wire.kv`) and releases them."""
        self._check_open()
        length = self.length
        blocks = self.table[: self.pool.blocks_for(length)]
        with self.pool._lock:
            for b in blocks:
                self.pool.ref(b)
        return HeldBlocks(self.pool, blocks, package_of(self.pool, length))

    @classmethod
    def import_blocks(cls, pool: BlockPool, held: HeldBlocks) -> PagedSequence:
        """A new sequence in `pool` that adopts the blocks `held` reserved in it (their
        references pass to the sequence; the package was checked when they were reserved).
        Raises ValueError for anything else: blocks of another pool, blocks already released
        or adopted."""
        if not isinstance(held, HeldBlocks):
            raise ValueError(f"a KV hand-off is HeldBlocks, got {type(held).__name__}")
        if held.pool is not pool:
            raise ValueError("the hand-off's blocks belong to another KV pool")
        seq = cls(pool)
        seq.table = held.take()
        for i in seq.lengths:
            seq.lengths[i] = held.package.length
        return seq


def dtype_name(dtype: torch.dtype) -> str:
    """A KV package's name of an element type (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def package_of(pool: BlockPool, length: int) -> KvPackage:
    """The metadata of `length` tokens of `pool`'s cache."""
    return KvPackage(
        version=EXPORT_VERSION,
        length=int(length),
        block_tokens=pool.block_tokens,
        layers=tuple(pool.layers),
        kv_shape=tuple(pool.kv_shape),
        dtype=dtype_name(pool.dtype),
    )


def check_package(pool: BlockPool, p: KvPackage) -> KvPackage:
    """`p` when its cache fits `pool` (version, block size, layers, KV shape, dtype, a length
    of at least one token); else ValueError naming the first field that does not."""
    if not isinstance(p, KvPackage):
        raise ValueError(f"a KV package is a KvPackage, got {type(p).__name__}")
    if p.version != EXPORT_VERSION:
        raise ValueError(f"KV package version {p.version!r}, this build reads {EXPORT_VERSION}")
    mine = package_of(pool, p.length)
    for key in ("block_tokens", "layers", "kv_shape", "dtype"):
        got, want = getattr(p, key), getattr(mine, key)
        if (tuple(got) if isinstance(got, list) else got) != want:
            raise ValueError(f"KV package {key} is {got!r}, this pool's is {want!r}")
    length = p.length
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"KV package length must be an int >= 1, got {length!r}")
    return p


# The states of a HeldBlocks (a list cell, shared with its finalizer).
_HELD, _TAKEN, _RELEASED = "held", "taken", "released"


def _drop(pool: BlockPool, blocks: tuple[int, ...], state: list[str]) -> None:
    with pool._lock:
        if state[0] != _HELD:
            return
        state[0] = _RELEASED
        for b in blocks:
            pool.unref(b)


class HeldBlocks:
    """Blocks of a pool held for one hand-off, with their metadata (`package`): on a prefill
    front end the request's blocks it sends from, on a decode front end the blocks it reserved
    for the sender to write into. One reference per block is held until a sequence adopts them
    (:meth:`take`, by :meth:`PagedSequence.import_blocks`) or :meth:`release` (idempotent; it
    also runs when the object is collected, so a hand-off dropped on any path leaks nothing)."""

    def __init__(self, pool: BlockPool, blocks: Iterable[int], package: KvPackage):
        self.pool = pool
        self.blocks = tuple(int(b) for b in blocks)
        self.package = package
        if len(self.blocks) != package.num_blocks:
            raise ValueError(
                f"{len(self.blocks)} blocks held for {package.length} tokens of "
                f"{package.block_tokens} per block"
            )
        self._state = [_HELD]
        self._finalizer = weakref.finalize(self, _drop, pool, self.blocks, self._state)

    @classmethod
    def reserve(cls, pool: BlockPool, package: KvPackage) -> HeldBlocks:
        """Fresh blocks of `pool` for a cache described by `package` (checked here, once:
        ValueError when it does not fit, KvPoolFullError when the pool has no room)."""
        check_package(pool, package)
        return cls(pool, pool.allocate_many(package.num_blocks), package)

    @property
    def held(self) -> bool:
        return self._state[0] == _HELD

    def take(self) -> list[int]:
        """The blocks, their references passing to the caller (once)."""
        with self.pool._lock:
            if self._state[0] != _HELD:
                raise ValueError(f"the hand-off's blocks were {self._state[0]} already")
            self._state[0] = _TAKEN
            self._finalizer.detach()
            return list(self.blocks)

    def release(self) -> None:
        """Drops the references (nothing once taken or released)."""
        self._finalizer()

    def __repr__(self) -> str:
        return (
            f"HeldBlocks({len(self.blocks)} blocks, {self.package.length} tokens, {self._state[0]})"
        )
