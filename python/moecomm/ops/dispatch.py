"""Dispatch packing: turn a batch routed to logical experts into one request per expert server.

The client routes each token to ``K`` logical experts (``topk_ids`` [T, K], ``-1`` = no expert).
An :class:`ExpertMap` says where each logical expert lives: a list of replicas, each a
``(server, local expert index)`` pair. :func:`pack_dispatch` picks one replica per (token, k),
quantizes the activations once (early, before any copy), and packs, for every server that got at
least one token, exactly the arrays of a request payload (``csrc/protocol/layout.h``):

- ``activations`` [n, H] in the wire dtype of the encoding (+ ``scales`` [n, S] f32 if quantized),
- ``expert_ids`` [n, K] int32: the server's LOCAL expert index, or ``-1`` = not for this server,
- ``scores`` [n, K] f32: the router weight (0 where ``expert_ids`` is ``-1``),
- ``token_index`` [n] int64: which row of the batch each packed row is, for :func:`combine`.

Rows keep batch order; columns keep the ``k`` order of ``topk_ids``. Nothing is computed on
values except the quantization, so packing is bit-exact against the pure-Python reference.

Zero copy: with ``into``, the caller hands out the memory each server's arrays are packed into
— the server's request slot itself when the transport maps it (``ClientChannel.request_views``)
— so a request is written once, by the gather that packs it, with no staging tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moecomm._C import Encoding
from moecomm.ops.quant import (
    QUANTIZED_ENCODINGS,
    check_activations,
    encoding_dtype,
    encoding_for_dtype,
    quantize,
    quantize_reference,
)

__all__ = ["ExpertMap", "ServerBatch", "pack_dispatch", "pack_dispatch_reference"]

# Marks a (token, k) pair that is not for a server: both the router's "no expert" and the wire's
# "not for this server" use it.
NO_EXPERT = -1
_INDEX_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ExpertMap:
    """Where every logical expert lives: ``replicas[e]`` = ``[(server, local_index), ...]``.

    A server may host any number of experts and replicas; ``local_index`` is the expert's index
    inside that server. Two logical experts never share one ``(server, local_index)`` slot.
    ``num_servers`` defaults to the largest server id + 1.
    """

    def __init__(
        self, replicas: Sequence[Sequence[tuple[int, int]]], num_servers: int | None = None
    ) -> None:
        reps = [tuple((int(s), int(j)) for s, j in r) for r in replicas]
        if not reps:
            raise ValueError("an expert map needs at least one logical expert, got 0")
        servers = [s for r in reps for s, _ in r]
        if num_servers is None:
            num_servers = max(servers, default=-1) + 1
        seen: dict[tuple[int, int], int] = {}
        for e, r in enumerate(reps):
            if not r:
                raise ValueError(f"logical expert {e} has no replica")
            for pair in r:
                s, j = pair
                if not 0 <= s < num_servers or j < 0:
                    raise ValueError(
                        f"replica {pair} of expert {e}: expected server in [0, {num_servers}) "
                        "and local index >= 0"
                    )
                if pair in seen:
                    raise ValueError(f"experts {seen[pair]} and {e} both claim replica {pair}")
                seen[pair] = e
        self._replicas = tuple(reps)
        self.num_servers = int(num_servers)
        counts = [len(r) for r in reps]
        # Flat replica tables: replica r of expert e is entry offsets[e] + r.
        self.num_replicas = torch.tensor(counts, dtype=torch.int64)
        self._offsets = torch.cumsum(self.num_replicas, 0) - self.num_replicas
        self._servers = torch.tensor([s for r in reps for s, _ in r], dtype=torch.int64)
        self._locals = torch.tensor([j for r in reps for _, j in r], dtype=torch.int32)
        self._on_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    @property
    def num_experts(self) -> int:
        return len(self._replicas)

    def replicas(self, expert: int) -> tuple[tuple[int, int], ...]:
        return self._replicas[expert]

    def without_server(self, server: int) -> ExpertMap:
        """The map with every replica on ``server`` dropped (a lost or draining server).

        Raises ValueError if some expert would be left without a replica.
        """
        kept = [[p for p in r if p[0] != server] for r in self._replicas]
        return ExpertMap(kept, self.num_servers)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(num_replicas, offsets, servers, locals) on ``device``, cached."""
        if device not in self._on_device:
            self._on_device[device] = tuple(
                t.to(device)
                for t in (self.num_replicas, self._offsets, self._servers, self._locals)
            )
        return self._on_device[device]

    def resolve(
        self, topk_ids: torch.Tensor, replica: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(server [T, K] int64, local index [T, K] int32) of every routed (token, k).

        ``replica`` picks the replica ordinal: an int tensor [T, K] (per choice) or [E] (per
        expert), each entry in ``[0, num_replicas[e])``. Without it the deterministic rule is
        ``token_index mod num_replicas[e]``: round robin over the batch, so replicas share the
        load and the same batch always goes to the same servers. Entries where ``topk_ids`` is
        ``-1`` come out as server ``-1``, local ``-1``. Arguments are checked by the caller.
        """
        counts, offsets, servers, locals_ = self.tables(topk_ids.device)
        valid = topk_ids >= 0
        ids = topk_ids.long().clamp(min=0)
        if replica is None:
            rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
            ordinal = rows % counts[ids]
        elif replica.dim() == 1:
            ordinal = replica.long()[ids]
        else:
            ordinal = replica.long()
        flat = offsets[ids] + ordinal
        server = torch.where(valid, servers[flat], NO_EXPERT)
        local = torch.where(valid, locals_[flat], NO_EXPERT)
        return server, local


@dataclass(frozen=True)
class ServerBatch:
    """One server's request: the arrays of its slot payload plus the rows they came from."""

    server: int
    activations: torch.Tensor  # [n, H] wire dtype
    scales: torch.Tensor | None  # [n, S] f32, None for unquantized encodings
    expert_ids: torch.Tensor  # [n, K] int32, local expert index or -1
    scores: torch.Tensor  # [n, K] f32
    token_index: torch.Tensor  # [n] int64, rows of the dispatched batch
    # Packed into memory from `into` (the server's slot): nothing is left to copy before sending.
    in_place: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.token_index.shape[0])


def _check_dispatch_args(
    x: object,
    topk_ids: object,
    topk_weights: object,
    expert_map: object,
    encoding: object,
    replica: object,
) -> Encoding:
    check_activations(x)
    assert isinstance(x, torch.Tensor)
    if not isinstance(expert_map, ExpertMap):
        raise TypeError(f"expert_map must be an ExpertMap, got {type(expert_map).__name__}")
    for name, v, dtypes in (
        ("topk_ids", topk_ids, _INDEX_DTYPES),
        ("topk_weights", topk_weights, _WEIGHT_DTYPES),
    ):
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
        if v.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in {dtypes}, got {v.dtype}")
        if v.dim() != 2 or v.shape[0] != x.shape[0] or v.shape[1] < 1:
            raise ValueError(f"{name} must have shape [T={x.shape[0]}, K>=1], got {tuple(v.shape)}")
        if v.device != x.device:
            raise ValueError(f"{name} must be on {x.device} like x, got {v.device}")
    assert isinstance(topk_ids, torch.Tensor) and isinstance(topk_weights, torch.Tensor)
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights must have the shape of topk_ids {tuple(topk_ids.shape)}, got "
            f"{tuple(topk_weights.shape)}"
        )
    e = expert_map.num_experts
    if topk_ids.numel() and not bool(((topk_ids >= NO_EXPERT) & (topk_ids < e)).all()):
        bad = topk_ids[(topk_ids < NO_EXPERT) | (topk_ids >= e)][0].item()
        raise ValueError(f"topk_ids must be in [-1, {e}), got {bad}")
    if replica is not None:
        _check_replica(replica, topk_ids, expert_map)
    if encoding is None:
        return encoding_for_dtype(x.dtype)
    if not isinstance(encoding, Encoding):
        raise TypeError(f"encoding must be a moecomm._C.Encoding, got {type(encoding).__name__}")
    return encoding


def _check_replica(replica: object, topk_ids: torch.Tensor, expert_map: ExpertMap) -> None:
    if not isinstance(replica, torch.Tensor) or replica.dtype not in _INDEX_DTYPES:
        got = replica.dtype if isinstance(replica, torch.Tensor) else type(replica).__name__
        raise TypeError(f"replica must be an int32/int64 tensor, got {got}")
    e = expert_map.num_experts
    if tuple(replica.shape) not in ((e,), tuple(topk_ids.shape)):
        raise ValueError(
            f"replica must have shape [E={e}] or {tuple(topk_ids.shape)}, got "
            f"{tuple(replica.shape)}"
        )
    if replica.device != topk_ids.device:
        raise ValueError(f"replica must be on {topk_ids.device}, got {replica.device}")
    counts = expert_map.tables(replica.device)[0]
    if replica.dim() == 1:
        ok = (replica >= 0) & (replica < counts)
    else:
        valid = topk_ids >= 0
        ok = ~valid | ((replica >= 0) & (replica < counts[topk_ids.long().clamp(min=0)]))
    if not bool(ok.all()):
        raise ValueError("replica ordinals must be in [0, num_replicas[expert]) of their expert")


def pack_dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: ExpertMap,
    encoding: Encoding | None = None,
    replica: torch.Tensor | None = None,
    into: Callable[[int, int, int], Any] | None = None,
) -> list[ServerBatch]:
    """Packs one request per server for a routed batch.

    x [T, H] bf16/fp16/f32; topk_ids [T, K] int32/int64 in [-1, E); topk_weights [T, K]
    bf16/fp16/f32; ``encoding`` of the request activations (default: the unquantized encoding of
    ``x.dtype``); ``replica`` as in :meth:`ExpertMap.resolve`. Returns the batches of the servers
    that got at least one token, in increasing server order, all tensors contiguous on
    ``x.device``. Inputs are not modified.

    ``into(server, num_tokens, topk)`` may return an object with contiguous ``activations``
    [n, H] (wire dtype), ``scales`` [n, S] (or None), ``expert_ids`` [n, K] int32 and
    ``scores`` [n, K] f32 to pack that server's request into (every element is written); the
    batch then holds those tensors and ``in_place`` is set. Returning None packs into new
    tensors, as without ``into``.
    """
    enc = _check_dispatch_args(x, topk_ids, topk_weights, expert_map, encoding, replica)
    if enc in QUANTIZED_ENCODINGS:
        wire, scales = quantize(x, enc)
    else:
        wire, scales = x.to(encoding_dtype(enc)), None
    k = int(topk_ids.shape[1])
    batches = []
    for s, rows, ids, sc in _route(topk_ids, topk_weights, expert_map, replica):
        dst = into(s, int(rows.numel()), k) if into is not None else None
        if dst is None:
            act = wire.index_select(0, rows)
            sca = None if scales is None else scales.index_select(0, rows)
            ids, sc = ids.contiguous(), sc.contiguous()
        else:
            # The gather writes the slot directly: the request's one copy of its activations.
            act = torch.index_select(wire, 0, rows, out=dst.activations)
            sca = None if scales is None else torch.index_select(scales, 0, rows, out=dst.scales)
            ids, sc = dst.expert_ids.copy_(ids), dst.scores.copy_(sc)
        batches.append(ServerBatch(s, act, sca, ids, sc, rows, in_place=dst is not None))
    return batches


def _route(topk_ids, topk_weights, expert_map: ExpertMap, replica):
    """(server, rows, expert_ids, scores) of every server that got a token, in server order."""
    weights = topk_weights.float()
    native = _native_router()
    if native is not None and topk_ids.device.type == "cpu":
        return _route_native(native, topk_ids, weights, expert_map, replica)
    server, local = expert_map.resolve(topk_ids, replica)
    out = []
    for s in torch.unique(server[server >= 0]).tolist():
        mine = server == s
        rows = torch.nonzero(mine.any(dim=1)).squeeze(1)
        mine_rows = mine.index_select(0, rows)
        ids = torch.where(mine_rows, local.index_select(0, rows), NO_EXPERT).int()
        sc = torch.where(mine_rows, weights.index_select(0, rows), 0.0)
        out.append((s, rows, ids, sc))
    return out


def _native_router():
    """moecomm._C.route_dispatch, or None in a source checkout without the built extension."""
    try:
        from moecomm import _C
    except ImportError:
        return None
    return getattr(_C, "route_dispatch", None)


def _route_native(native, topk_ids, weights, expert_map: ExpertMap, replica):
    """_route in one native pass (csrc/kernels/cpu/dispatch_route.h); the same results."""
    t, k = topk_ids.shape
    ids64 = topk_ids.to(torch.int64).contiguous()
    weights = weights.contiguous()
    counts, offsets, servers, locals_ = expert_map.tables(topk_ids.device)
    rule, rep = 0, None
    if replica is not None:
        rule, rep = (1 if replica.dim() == 1 else 2), replica.to(torch.int64).contiguous()
    n_srv = expert_map.num_servers
    per_server = torch.empty(n_srv, dtype=torch.int64)
    rows = torch.empty(n_srv, t, dtype=torch.int64)
    ids = torch.empty(n_srv, t, k, dtype=torch.int32)
    scores = torch.empty(n_srv, t, k, dtype=torch.float32)
    native(
        t, k, ids64.data_ptr(), weights.data_ptr(), expert_map.num_experts, counts.data_ptr(),
        offsets.data_ptr(), servers.data_ptr(), locals_.data_ptr(), rule,
        0 if rep is None else rep.data_ptr(), n_srv, per_server.data_ptr(), rows.data_ptr(),
        ids.data_ptr(), scores.data_ptr(),
    )  # fmt: skip
    return [
        (s, rows[s, :n], ids[s, :n], scores[s, :n]) for s, n in enumerate(per_server.tolist()) if n
    ]


def pack_dispatch_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: ExpertMap,
    encoding: Encoding | None = None,
    replica: torch.Tensor | None = None,
) -> list[ServerBatch]:
    """Pure-Python reference of :func:`pack_dispatch`: explicit loops, same result bit for bit."""
    enc = _check_dispatch_args(x, topk_ids, topk_weights, expert_map, encoding, replica)
    t, k = topk_ids.shape
    ids = topk_ids.tolist()
    weights = topk_weights.float()
    choice: dict[tuple[int, int], tuple[int, int]] = {}
    for i in range(t):
        for j in range(k):
            e = ids[i][j]
            if e == NO_EXPERT:
                continue
            reps = expert_map.replicas(e)
            if replica is None:
                r = i % len(reps)
            else:
                r = int(replica[e] if replica.dim() == 1 else replica[i, j])
            choice[i, j] = reps[r]
    quantized = enc in QUANTIZED_ENCODINGS
    if quantized:
        wire, scales = quantize_reference(x, enc)
    else:
        wire, scales = x.to(encoding_dtype(enc)), None
    batches = []
    for s in range(expert_map.num_servers):
        rows = [
            i for i in range(t) if any(choice.get((i, j), (NO_EXPERT,))[0] == s for j in range(k))
        ]
        if not rows:
            continue
        eids = [
            [
                choice[i, j][1] if choice.get((i, j), (NO_EXPERT,))[0] == s else NO_EXPERT
                for j in range(k)
            ]
            for i in rows
        ]
        score = torch.zeros(len(rows), k, dtype=torch.float32, device=x.device)
        for r, i in enumerate(rows):
            for j in range(k):
                if eids[r][j] != NO_EXPERT:
                    score[r, j] = weights[i, j]
        batches.append(
            ServerBatch(
                server=s,
                activations=torch.stack([wire[i] for i in rows]),
                scales=torch.stack([scales[i] for i in rows]) if quantized else None,
                expert_ids=torch.tensor(eids, dtype=torch.int32, device=x.device),
                scores=score,
                token_index=torch.tensor(rows, dtype=torch.int64, device=x.device),
            )
        )
    return batches
