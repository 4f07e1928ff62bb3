"""The model, the placement and the traffic of the chaos trials, shared by the test process and
the client processes: both derive every batch from its key, so the test can recompute the
fault-free answer of any request a client reports."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from moecomm.runtime import LayerExperts
from moecomm.runtime.launch import ModelSpec

SPEC = ModelSpec(num_layers=2, num_experts=6, hidden=48, intermediate=24, seed=23)
NUM_SERVERS = 3
# Two experts per token: a sum of two terms is the same in any order, so a failover (which
# changes which server adds which term) stays bit-exact with the in-process reference.
TOPK = 2
# Tokens per micro-batch at most; batch sizes are drawn from 0 ... MAX_TOKENS inclusive.
MAX_TOKENS = 16
# Share of batches drawn at each edge (0 tokens, MAX_TOKENS tokens): edges are where
# size-dependent bugs live, and a uniform draw would hit them once in 17 batches.
EDGE_SHARE = 0.15
# Every expert on exactly two of the three servers: any one server may fail.
HOSTED = [
    {
        layer: [e for e in range(SPEC.num_experts) if s in (e % 3, (e + 1) % 3)]
        for layer in range(SPEC.num_layers)
    }
    for s in range(NUM_SERVERS)
]


@dataclass(frozen=True)
class BatchKey:
    """Names one micro-batch of one client process: what it sent is a function of this."""

    seed: int
    client_id: int
    generation: int  # which process of this client id (ids are reused by new processes)
    run: int  # connect ... disconnect cycles of one process
    step: int
    micro: int  # 0 = micro-batch A, 1 = micro-batch B

    def as_tuple(self) -> tuple:
        return (self.seed, self.client_id, self.generation, self.run, self.step, self.micro)


def _stream_seed(*parts) -> int:
    """A 63-bit seed from any parts, identical in every process (unlike hash())."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def make_batch(key: BatchKey) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(x [n, H] f32, topk_ids [n, TOPK] int32, topk_weights [n, TOPK] f32, layer) of `key`."""
    g = torch.Generator().manual_seed(_stream_seed("batch", *key.as_tuple()))
    edge = float(torch.rand((), generator=g))
    if edge < EDGE_SHARE:
        n = 0
    elif edge < 2 * EDGE_SHARE:
        n = MAX_TOKENS
    else:
        n = int(torch.randint(1, MAX_TOKENS, (), generator=g))
    layer = int(torch.randint(0, SPEC.num_layers, (), generator=g))
    x = torch.randn(n, SPEC.hidden, generator=g)
    # Distinct experts per token.
    ids = torch.rand(n, SPEC.num_experts, generator=g).argsort(dim=1)[:, :TOPK].to(torch.int32)
    w = torch.rand(n, TOPK, generator=g)
    return x, ids, w, layer


def rng_seed(*parts) -> int:
    """Seed of a random.Random for one decision stream of a trial."""
    return _stream_seed("rng", *parts)


class Reference:
    """The fault-free answer computed in this process: every expert of a layer in one
    LayerExperts (local index = logical id), the same batch-invariant float32 kernel the
    servers run."""

    def __init__(self):
        experts = SPEC.experts()
        self.layers = {layer: LayerExperts(layer, e) for layer, e in experts.items()}
        self._cache: dict[tuple, bytes] = {}

    def output(self, key: BatchKey) -> torch.Tensor:
        x, ids, w, layer = make_batch(key)
        if x.shape[0] == 0:
            return torch.zeros(0, SPEC.hidden)
        (y,) = self.layers[layer].forward([x], [ids], [w])
        return y.float()

    def output_bytes(self, key: BatchKey) -> bytes:
        k = key.as_tuple()
        if k not in self._cache:
            self._cache[k] = self.output(key).numpy().tobytes()
        return self._cache[k]

    def mismatch(self, key: BatchKey, got: bytes) -> str | None:
        """None when `got` is bit-exact, else what differs."""
        want = self.output_bytes(key)
        if got == want:
            return None
        if len(got) != len(want):
            return f"{len(got)} bytes, expected {len(want)}"
        a = torch.frombuffer(bytearray(got), dtype=torch.float32)
        b = torch.frombuffer(bytearray(want), dtype=torch.float32)
        return f"max |diff| {float((a - b).abs().max()):.3g}"
