"""The low-latency engine under ``moecomm.compat.nixl_ep``: ``deep_ep.Buffer``'s host path in
shrink mode (masks always on, as NIXL-EP's kernels always honour their mask buffer), with the
channels to each peer set up when that pair first meets instead of at one rendezvous of a fixed
group. Rank capacity = ``num_ranks`` of the engine; a rank not connected is masked and has a
placeholder instead of channels.

Round numbering (the engine's request rounds and combine answers carry sequence numbers derived
from two counters; docs/compat-nixl-ep.md, "Rounds"): a round with at least one live peer uses
and advances the shared counters, which every pair of ranks agrees on; a round with no live peer
(a rank warming up alone behind masks, as vLLM's ``mask_remote_ranks`` does) is numbered in a
disjoint range from ``SOLO_BASE`` and leaves the shared counters alone. Ranks that meet for the
first time adopt the larger of their shared counters.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from moecomm.compat.low_latency.buffer import Buffer as DeepEPBuffer
from moecomm.compat.low_latency.layout import NUM_SLOTS, LLShape, check_shape, slot_layout
from moecomm.compat.low_latency.replicas import ReplicaPlan
from moecomm.errors import PeerOfflineError
from moecomm.wire.client import ClientChannel
from moecomm.wire.server import ServerChannel
from moecomm.wire.transport import Transport

__all__ = ["SOLO_BASE", "Engine"]

log = logging.getLogger("moecomm.compat.nixl_ep")

# Requests of a solo round are numbered from here (below the answers' COMBINE_SEQ_BASE = 2^40).
SOLO_BASE = 1 << 39
_ROUNDS, _COMBINES = "_num_rounds", "_num_combines"
_KEEP_FAILURES = 64


class _NoStore:
    """The engine's rendezvous store: never used (pairs are set up by the runtime)."""


class _Unconnected:
    """Stands in for the channels of a rank this one has none with. The engine never calls it
    for a masked rank; a wait on it (a rank unmasked between a dispatch and its combine without
    a round to set the pair up in) fails like an offline peer, so shrink mode masks the rank."""

    def __init__(self, peer: int) -> None:
        self.peer = peer

    def _offline(self, *args, **kwargs):
        raise PeerOfflineError(
            f"rank {self.peer} has no channels with this rank yet (they are set up at the "
            "first dispatch, barrier or clean in which both ranks see each other unmasked)"
        )

    send = ring = wait = release = poll = respond = connect = announce_offline = _offline

    def close(self) -> None:
        return None

    def mark_offline(self) -> None:
        return None


class Engine(DeepEPBuffer):
    """``deep_ep.Buffer`` with ``enable_shrink=True`` whose channels are added and removed pair by
    pair (``open_pair`` / ``connect_pair`` / ``close_pair``); see the module docstring."""

    def __init__(
        self,
        rank: int,
        num_ranks: int,
        timeout: float,
        replicas: dict[int, list[int]] | None,
        transport: Transport,
    ) -> None:
        super().__init__(
            None,
            low_latency_mode=True,
            explicitly_destroy=True,
            enable_shrink=True,
            rank=rank,
            num_ranks=num_ranks,
            store=_NoStore(),
            timeout=timeout,
            replicas=replicas,
        )
        self._transport = transport
        self._solo = {_ROUNDS: 0, _COMBINES: 0}
        self.layout = None
        self.failures: list[str] = []  # the last reasons ranks were masked, newest last
        # NIXL-EP: every rank but this one is masked until connected.
        self._mask.fill_(1)
        self._mask[rank] = 0

    # ------------------------------------------------------------------ the runtime's surface
    @property
    def destroyed(self) -> bool:
        return self._destroyed

    @property
    def num_local(self) -> int:
        """Local expert slots of this rank (the rows of recv_x); known once set up."""
        return self._num_local

    @property
    def plan(self) -> ReplicaPlan:
        """The replica plan (which ranks host which experts); known once set up."""
        return self._plan

    def is_masked(self, p: int) -> bool:
        return bool(self._mask[p])

    def set_masked(self, p: int, masked: bool) -> None:
        """Masks (no data to or from it) or unmasks rank `p`; the runtime checks `p` first."""
        self._mask[p] = int(bool(masked))

    def mask_state(self) -> torch.Tensor:
        """A copy of the mask: int32 ``[num_ranks]``, 1 = masked."""
        return self._mask.clone()

    def set_up(self, shape: LLShape) -> None:
        """Sets this rank up for `shape` (at the first dispatch); pairs are added later."""
        self._setup(shape)

    # ------------------------------------------------------------------ set-up, pairs
    def _exchange(self, mine: dict, prefix: str | None = None) -> list[dict]:
        raise RuntimeError("nixl_ep sets its channels up pair by pair, never in one rendezvous")

    def _setup(self, shape: LLShape, prefix: str | None = None) -> None:
        """What deep_ep.Buffer._setup does for this rank alone: the replica plan, the slot layout,
        placeholders for every peer and the channels of the pair with itself."""
        check_shape(shape, self.num_ranks)
        plan = ReplicaPlan(self._replica_spec, shape.num_experts, self.num_ranks)
        self.layout = slot_layout(shape, self.num_ranks, plan.max_local)
        self._servers = [_Unconnected(p) for p in range(self.num_ranks)]
        self._clients = [_Unconnected(p) for p in range(self.num_ranks)]
        self._plan, self._num_local = plan, len(plan.local[self.rank])
        try:
            self.connect_pair(self.rank, self.open_pair(self.rank))
        except BaseException:
            self._close_channels()
            raise
        self.shape = shape

    def open_pair(self, p: int) -> dict:
        """Our channels for rank `p` (made once): the handles `p` needs to connect to them."""
        if isinstance(self._servers[p], _Unconnected):
            server = ServerChannel(self._transport, self.layout, p, NUM_SLOTS, name=f"rank {p}")
            try:
                client = ClientChannel(
                    self._transport, self.layout, self.rank, NUM_SLOTS, name=f"rank {p}"
                )
            except BaseException:
                server.close()
                raise
            self._servers[p], self._clients[p] = server, client
        return {"server": self._servers[p].handle, "client": self._clients[p].handle}

    def connect_pair(self, p: int, theirs: dict) -> None:
        """Attaches our channels for `p` to the ones `p` made for us (its open_pair handles)."""
        self._clients[p].connect(theirs["server"])
        self._servers[p].connect(theirs["client"])

    def has_pair(self, p: int) -> bool:
        return self.shape is not None and not isinstance(self._servers[p], _Unconnected)

    def close_pair(self, p: int) -> None:
        """Drops our channels for `p`: its waits on our answers fail at once (OFFLINE)."""
        if not self.has_pair(p):
            return
        server, client = self._servers[p], self._clients[p]
        with contextlib.suppress(Exception):
            server.announce_offline()
        server.close()
        client.close()
        self._servers[p], self._clients[p] = _Unconnected(p), _Unconnected(p)

    def _peer_failed(self, p: int, exc: BaseException) -> None:
        self.failures = [*self.failures[-(_KEEP_FAILURES - 1) :], f"rank {p}: {exc}"]
        log.warning("nixl_ep rank %d masks rank %d: %s", self.rank, p, exc)
        super()._peer_failed(p, exc)

    def fail(self, p: int, exc: BaseException) -> None:
        """Masks `p` for `exc` (a timeout or a dead process), as the engine's own waits do."""
        self._peer_failed(p, exc)

    # ------------------------------------------------------------------ numbering
    def counters(self) -> tuple[int, int]:
        """The shared (rounds, combines) counters."""
        return self._num_rounds, self._num_combines

    def adopt(self, rounds: int, combines: int) -> None:
        """Takes the larger counters of a peer met for the first time."""
        self._num_rounds = max(self._num_rounds, rounds)
        self._num_combines = max(self._num_combines, combines)

    @contextlib.contextmanager
    def numbered(self, combine: bool, solo: bool):
        """Runs an engine call in the shared numbering, or (solo) in the solo range."""
        if not solo:
            yield
            return
        attr = _COMBINES if combine else _ROUNDS
        shared, first = getattr(self, attr), SOLO_BASE + self._solo[attr]
        setattr(self, attr, first)
        try:
            yield
        finally:
            self._solo[attr] += getattr(self, attr) - first
            setattr(self, attr, shared)
