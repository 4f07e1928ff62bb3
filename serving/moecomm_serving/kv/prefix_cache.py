"""The prefix cache: full KV blocks kept after their request, found again by their tokens.

Block j of a token sequence is keyed by a chained hash: ``key_j = H(key_{j-1} || tokens of
block j)``, so a key names the whole prefix up to the end of block j, not only that block's own
tokens (the same 16 tokens after different prefixes have different keys and different keys and
values). A lookup walks a prompt's full blocks from the start and stops at the first miss; the
hit's blocks join the new sequence's block table, whose prefill then starts after them.

Only full blocks are kept, and at least the prompt's last token is always prefilled (its logits
choose the first output token), so a hit never has to write into a shared block. The cache
holds one reference per kept block (:class:`~moecomm_serving.kv.blocks.BlockPool` refcounts):
a block whose count is above one is in some running sequence and is never evicted; the others
go least recently used first when the byte budget is reached. Entries also keep their tokens, so
a hash collision can never serve another prefix's keys.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moecomm_serving.kv.blocks import BlockPool, PagedSequence

# Digest bytes of a block key: 128 bits make an accidental collision negligible; entries also
# compare their tokens, so one would cost a miss, never a wrong answer.
KEY_BYTES = 16
# The key before the first block.
ROOT_KEY = b"\0" * KEY_BYTES


def block_keys(tokens: Sequence[int], block_tokens: int) -> list[bytes]:
    """Chained keys of the full blocks of `tokens`."""
    keys, parent = [], ROOT_KEY
    for j in range(len(tokens) // block_tokens):
        chunk = np.asarray(tokens[j * block_tokens : (j + 1) * block_tokens], dtype=np.int64)
        parent = hashlib.blake2b(parent + chunk.tobytes(), digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys


@dataclass
class PrefixCacheStats:
    """Counters for /metrics; written by the engine thread only."""

    lookups: int = 0  # prompts looked up
    hits: int = 0  # prompts that reused at least one block
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # prompt tokens served from the cache (prefill skipped)
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    saved_prefill_s: float = 0.0  # estimated prefill time skipped (Engine.seconds_per_token)

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens that came from the cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class _Entry:
    block: int
    tokens: tuple[int, ...]


class PrefixCache:
    """Blocks of finished (or running) prompts, kept under `max_bytes` of `pool`'s blocks."""

    def __init__(self, pool: BlockPool, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.pool = pool
        self.max_bytes = int(max_bytes)
        self.max_blocks = self.max_bytes // pool.block_bytes
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recent first
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.pool.block_bytes

    def match(self, prompt: Sequence[int]) -> tuple[list[int], int]:
        """The cached blocks that start `prompt` and how many tokens they hold.

        The caller receives one reference per block (hand them to
        :meth:`PagedSequence.adopt`). The last prompt token is never served from the cache.
        """
        b = self.pool.block_tokens
        usable = (len(prompt) - 1) // b * b if prompt else 0
        found: list[tuple[bytes, _Entry]] = []
        for j, key in enumerate(block_keys(prompt[:usable], b)):
            entry = self._entries.get(key)
            if entry is None or entry.tokens != tuple(prompt[j * b : (j + 1) * b]):
                break
            found.append((key, entry))
        # Touch the deepest block first, so a prefix ends more recent than its extensions and
        # eviction takes the leaves of a chain before the blocks every leaf depends on.
        for key, _ in reversed(found):
            self._entries.move_to_end(key)
        for _, entry in found:
            self.pool.ref(entry.block)
        s = self.stats
        s.lookups += 1
        s.query_tokens += len(prompt)
        s.hits += bool(found)
        s.hit_tokens += len(found) * b
        return [e.block for _, e in found], len(found) * b

    def cached_tokens(self, prompt: Sequence[int]) -> int:
        """How many tokens of `prompt` :meth:`match` would serve now, asked from outside the
        engine (a router choosing where to prefill): no block is taken, nothing is counted or
        reordered, so it may be read from another thread; the answer may be stale by the time
        the prompt arrives (a hint, never a promise)."""
        b = self.pool.block_tokens
        usable = (len(prompt) - 1) // b * b if prompt else 0
        n = 0
        for j, key in enumerate(block_keys(prompt[:usable], b)):
            entry = self._entries.get(key)
            if entry is None or entry.tokens != tuple(prompt[j * b : (j + 1) * b]):
                break
            n += b
        return n

    def insert(self, tokens: Sequence[int], seq: PagedSequence) -> int:
        """Keeps the full blocks of `seq`, whose cache holds `tokens` (at least its first
        ``seq.length``). Returns how many blocks were added; stops when the budget is full of
        blocks in use."""
        if seq.pool is not self.pool:
            raise ValueError("the sequence lives in another block pool")
        b = self.pool.block_tokens
        cached = min(len(tokens), seq.length)
        added = 0
        keys = block_keys(tokens[:cached], b)
        for j, key in enumerate(keys):
            if key in self._entries:
                continue
            if not self._make_room():
                break
            block = seq.table[j]
            self.pool.ref(block)
            self._entries[key] = _Entry(block, tuple(tokens[j * b : (j + 1) * b]))
            added += 1
        for key in reversed(keys):  # leaves first, as in match()
            if key in self._entries:
                self._entries.move_to_end(key)
        self.stats.inserted_blocks += added
        return added

    def _make_room(self) -> bool:
        """Evicts least-recent unused blocks until one more fits; False if none can go."""
        while len(self._entries) >= self.max_blocks:
            victim = next(
                (k for k, e in self._entries.items() if self.pool.refcount(e.block) == 1), None
            )
            if victim is None:
                return False
            self.pool.unref(self._entries.pop(victim).block)
            self.stats.evicted_blocks += 1
        return True

    def clear(self) -> None:
        """Drops every block not in use (all of them when no sequence runs)."""
        for key in [k for k, e in self._entries.items() if self.pool.refcount(e.block) == 1]:
            self.pool.unref(self._entries.pop(key).block)
            self.stats.evicted_blocks += 1
