"""The attention client: dispatch a layer's routed tokens to expert servers, combine answers.

`dispatch` packs one request per server that hosts a chosen replica (quantizing early, before
the copy), writes and signals — it does not wait. `combine` waits with a deadline for every
server contacted and sums the partial results in server order, so the result does not depend on
which answer arrived first. `num_slots` micro-batches can be in flight at once (two give
double-batch overlap: the attention of batch B runs while batch A is with the experts).

Rerouting: `combine` sleeps on the answers of all the step's servers at once, and on their
deaths (the shm transport's life words wake it as a server dies). The moment one server fails,
its share goes to live replicas — into a spare slot each connection keeps for such re-sends, so
the replica can take it even while it still owes this step its own answer — and the step's
other answers keep coming in meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from moecomm.errors import (
    DeadlineExceededError,
    MoecommError,
    PeerLostError,
    PeerOfflineError,
    RemoteError,
)
from moecomm.ops.combine import combine as combine_partials
from moecomm.ops.dispatch import ExpertMap, pack_dispatch
from moecomm.runtime.server import MAX_SLOTS_PER_CLIENT
from moecomm.runtime.server_pool import ServerPool
from moecomm.wire.channel import DEFAULT_TIMEOUT_S
from moecomm.wire.choose import TransportSet
from moecomm.wire.client import ClientChannel, wait_first
from moecomm.wire.protocol import ResponseStatus, SlotLayout, as_encoding
from moecomm.wire.transport import Transport

log = logging.getLogger("moecomm.client")

REPLICA_POLICIES = ("round_robin", "least_outstanding")
# Fast retry (EaaS): at most this many attempts for a failed share, each on servers not tried
# before; a dead peer gets no exponential backoff, it is evicted.
MAX_ATTEMPTS = 3
# How long a server that failed a request stays out of the expert map.
DEFAULT_EVICT_S = 30.0
# A combine that follows a membership re-checks for loss events this often while it waits.
WAIT_SLICE_S = 0.05
# Default client ids are random, not the pid: in containers every front end is PID 1, and pids
# collide across hosts. 62 bits keep them positive in every signed 64-bit field on the way.
CLIENT_ID_BITS = 62
# Answers after which a request is re-sent elsewhere instead of failing the dispatch: the server
# drains, or our expert map is older than its placement (re-read, then re-sent).
_RESEND_STATUSES = (int(ResponseStatus.DRAINING), int(ResponseStatus.STALE_MAP))
# When combine re-sends a failed server's share: "at_once" (default), the moment the failure is
# seen, into the replica's spare slot, while the step's other answers are still awaited;
# "after_step", once every server of the step answered or failed (no spare slot: retries reuse
# the step's slot) — the behaviour before spare slots, kept for bench/recovery/chaos_reroute.py.
RESEND_ENV = "MOECOMM_RESEND"
RESEND_MODES = ("at_once", "after_step")
# With servers on several transports (shm and nixl) no single sleep covers every answer: each
# transport's answers are waited for in turn, this long at a time.
MIXED_TRANSPORT_SLICE_S = 0.002


def resend_mode(mode: str | None = None) -> str:
    """`mode`, else MOECOMM_RESEND, else "at_once"; anything else is an error."""
    mode = mode or os.environ.get(RESEND_ENV, "") or "at_once"
    if mode not in RESEND_MODES:
        raise ValueError(f"resend must be one of {RESEND_MODES} ({RESEND_ENV}), got {mode!r}")
    return mode


def random_client_id() -> int:
    return secrets.randbits(CLIENT_ID_BITS)


@dataclass
class Sent:
    """One request of a dispatch: which server, its sequence number, the batch rows it carries
    and which (row, k) pairs of those rows it was asked to compute."""

    server: int
    seq: int
    token_index: torch.Tensor
    pairs: torch.Tensor  # [n, K] bool
    # Set when the send itself failed (a network transport finds a dead peer at the write):
    # combine re-sends this share to replicas as it does for a failed wait.
    error: Exception | None = None


@dataclass(eq=False)  # compared by identity: the fields hold tensors
class _Share:
    """The (row, k) pairs of a failed request, re-sent to replicas: its partial, once every part
    answered, is the sum of the parts' answers in the order they were sent, and takes the
    failed request's place (`pos` in the step, or `index` among its parent share's parts)."""

    rows: torch.Tensor  # rows of the handle's batch
    pairs: torch.Tensor  # [len(rows), K] bool
    attempt: int  # 1 for the first re-send of a request, +1 for each re-send of a part
    errors: list[str]
    parent: _Share | None = None
    pos: int = -1  # in handle.sent, when parent is None
    index: int = -1  # in parent.parts otherwise
    sent: list[Sent] | None = None  # the parts, once sent (token_index into `rows`)
    parts: list | None = None  # per part: its answer (f32, owned), or None while awaited


@dataclass(eq=False)
class _Await:
    """An answer combine waits for: a request of the step (`share` None, at `pos`) or a part
    of a re-sent share (in the spare slot)."""

    sent: Sent
    slot: int
    deadline: float
    pos: int = -1
    share: _Share | None = None
    index: int = -1  # among share.parts


@dataclass(eq=False)
class _Gather:
    """What one re-send-at-once combine keeps track of."""

    handle: DispatchHandle
    timeout: float
    partials: list  # per request of the step: its answer, or its re-sent share's sum
    waiting: list[_Await] = field(default_factory=list)
    queued: list[_Share] = field(default_factory=list)  # re-sends whose spare slot is in use
    busy: set[int] = field(default_factory=set)  # servers with a re-send in their spare slot


@dataclass
class DispatchHandle:
    slot: int
    layer_id: int
    num_tokens: int
    sent: list[Sent]  # in server order
    out_dtype: torch.dtype
    replica: torch.Tensor | None  # the replica ordinal chosen for each logical expert
    # The inputs, kept (not copied) so a failed server's share can be re-sent to replicas:
    # callers must not modify them before combine().
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    done: bool = False


class AttentionClient:
    """Client of a set of expert servers, reached by their control-plane URLs.

    `transport`: a Transport, or "shm", "nixl" or "auto" (per server: shm when it shares this
    host's /dev/shm, nixl otherwise; wire/choose.py). `host`: this process's address on
    the network the servers are reached over (nixl carries bytes over that interface)."""

    def __init__(
        self,
        servers: Sequence[str],
        client_id: int | None,
        hidden: int,
        topk: int,
        max_tokens: int,
        encoding: str = "bf16",
        out_dtype: torch.dtype = torch.bfloat16,
        num_slots: int = 2,
        token: str = "",
        timeout: float = DEFAULT_TIMEOUT_S,
        replica_policy: str = "round_robin",
        transport: Transport | str | None = None,
        evict_s: float = DEFAULT_EVICT_S,
        host: str | None = None,
        resend: str | None = None,
    ):
        if not servers:
            raise ValueError("an attention client needs at least one expert server")
        if replica_policy not in REPLICA_POLICIES:
            raise ValueError(
                f"replica_policy must be one of {REPLICA_POLICIES}, got {replica_policy!r}"
            )
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        # None: a random id (see CLIENT_ID_BITS); an id held by another live client is refused.
        self.client_id = random_client_id() if client_id is None else int(client_id)
        self.layout = SlotLayout(
            max_tokens, hidden, topk, as_encoding(encoding), as_encoding(out_dtype)
        )
        self.encoding = self.layout.encoding
        self.out_dtype = out_dtype
        self.replica_policy = replica_policy
        self.resend = resend_mode(resend)
        self.num_slots = num_slots
        # The spare slot of every connection, for re-sends at once (one more than the
        # micro-batches); none at the server's limit, and then re-sends wait for the step.
        at_once = self.resend == "at_once" and num_slots < MAX_SLOTS_PER_CLIENT
        self._spare = num_slots if at_once else None
        self.pool = ServerPool(
            list(servers),
            self.client_id,
            self.layout,
            num_slots + (1 if at_once else 0),
            token,
            timeout,
            TransportSet(transport, host, timeout),
            evict_s,
        )
        self.failovers = 0
        # Membership events, appended by the watcher's thread and applied by ours.
        self._events: deque = deque()
        self._registration = None
        self._watcher = None
        self._busy = [False] * num_slots
        self._next_slot = 0
        # The combine's f32 accumulator, warm from the start (a fresh one per call would be
        # allocated, and first-touched, on every layer of every step).
        self._acc = torch.zeros(max_tokens, hidden, dtype=torch.float32)
        # Round-robin position per layer: one shared counter would advance by the number of
        # layers between two calls of a layer, and with an even layer count a layer whose
        # experts have two replicas would always pick the same one.
        self._rr: dict[int, int] = {}

    # ------------------------------------------------------------------ servers, expert maps
    def connect(self) -> None:
        """Connect handshake with every server; builds the expert map of every layer.

        A server that cannot be reached (down, stopped) is left out and connected to later, once
        its /health answers, as long as every expert it would serve has another live replica;
        a server that refuses the connect (bad token, id in use, wrong layout) is an error."""
        try:
            self.pool.connect_all()
        except Exception:
            self.close()
            raise

    def add_server(self, url: str) -> int:
        """Elastic join: connects to a new server and routes to it from the next dispatch on.
        Returns its index. A known URL is re-admitted (eviction lifted) instead."""
        return self.pool.add(url)

    def remove_server(self, url: str) -> None:
        """A server left (monitor event or drain): stop routing to it for good."""
        self.pool.remove(url)

    def live_urls(self) -> list[str]:
        """The servers this client is connected to now (safe to call from another thread: a
        placement controller reads it)."""
        urls, channels = list(self.urls), list(self.channels)
        return [u for u, ch in zip(urls, channels, strict=False) if ch is not None]

    def evict(self, server: int, reason: str = "") -> None:
        """Takes `server` out of every expert map for `evict_s` seconds, and then until its
        /health passes (probed in the background)."""
        self.pool.evict(server, reason)

    # Connection settings and server state live in the pool, once (num_slots, the micro-batches,
    # is ours: the pool's connections may hold the spare slot besides).
    token = property(lambda self: self.pool.token)
    timeout = property(lambda self: self.pool.timeout)
    evict_s = property(lambda self: self.pool.evict_s)
    urls = property(lambda self: self.pool.urls)
    channels = property(lambda self: self.pool.channels)
    sessions = property(lambda self: self.pool.sessions)
    hosted = property(lambda self: self.pool.hosted)
    maps = property(lambda self: self.pool.maps)
    missing = property(lambda self: self.pool.missing)
    evicted = property(lambda self: self.pool.evicted)
    outstanding = property(lambda self: self.pool.outstanding)
    reconnects = property(lambda self: self.pool.reconnects)
    transport = property(lambda self: self.pool.transport)

    def follow(self, membership, ttl: float) -> None:
        """Registers this client (role "client") with a lease of `ttl` and follows the
        servers: a join is connected to at the next dispatch, a loss or a drain takes the
        server out at once — also under a combine already waiting on it."""
        from moecomm.membership import Member

        self._registration = membership.register(Member("client", str(self.client_id)), ttl)
        self._watcher = membership.watch(role="server", callback=self._events.append)

    def sync_membership(self) -> None:
        """Applies the membership events heard so far (every dispatch does this first): an
        idle client calls it to connect to servers that joined meanwhile."""
        self._apply_events()

    def _apply_events(self) -> None:
        while self._events:
            ev = self._events.popleft()
            url = ev.member.endpoints.get("control")
            if url is None:
                continue
            leaving = ev.kind == "loss" or ev.member.metadata.get("draining") == "1"
            if leaving:
                if url in self.urls and self.channels[self.urls.index(url)] is not None:
                    self.remove_server(url)
            elif url not in self.urls or self.channels[self.urls.index(url)] is None:
                # Not reachable yet: its next event or a later join retries.
                with contextlib.suppress(ConnectionError, MoecommError):
                    self.add_server(url)

    # ------------------------------------------------------------------ data path
    def _replicas(self, emap: ExpertMap, layer_id: int) -> torch.Tensor:
        if self.replica_policy == "round_robin":
            rr = self._rr[layer_id] = self._rr.get(layer_id, 0) + 1
            return (rr + torch.arange(emap.num_experts)) % emap.num_replicas
        # least outstanding: for every expert, the replica whose server has the fewest tokens
        # in flight (ties to the lower replica ordinal, so the choice is deterministic).
        load = torch.tensor(self.outstanding, dtype=torch.int64)
        choice = torch.zeros(emap.num_experts, dtype=torch.int64)
        for e in range(emap.num_experts):
            servers = [s for s, _ in emap.replicas(e)]
            choice[e] = int(torch.argmin(load[servers]))
        return choice

    def _check_routable(self, layer_id: int, topk_ids: torch.Tensor) -> ExpertMap:
        emap = self.maps.get(layer_id)
        if emap is None:
            raise ValueError(
                f"layer {layer_id}: no connected server hosts it "
                f"(known layers: {sorted(self.maps)})"
            )
        lost = self.missing.get(layer_id)
        if lost:
            used = set(topk_ids[topk_ids >= 0].unique().tolist()) & set(lost)
            if used:
                raise MoecommError(f"layer {layer_id}: no live replica of expert(s) {sorted(used)}")
        return emap

    def _send(self, slot: int, layer_id: int, x, topk_ids, topk_weights, emap) -> tuple:
        replica = self._replicas(emap, layer_id)

        def into(server: int, n: int, k: int):
            # Zero copy: a server whose slots this process maps gets its request packed in place.
            ch = self.channels[server]
            return ch.request_views(slot, n, k, self.encoding) if ch is not None else None

        batches = pack_dispatch(
            x, topk_ids, topk_weights, emap, encoding=self.encoding, replica=replica, into=into
        )
        sent = []
        for b in batches:
            ch = self.channels[b.server]
            n, k = b.num_tokens, int(b.expert_ids.shape[1])
            # Read before the commit: from then on an in-place batch's arrays are the server's.
            pairs = b.expert_ids >= 0
            try:
                if b.in_place:
                    seq = ch.commit(slot, n, k, layer_id, self.encoding, wake=False)
                else:
                    seq = ch.send(
                        slot,
                        b.activations,
                        b.expert_ids,
                        b.scores,
                        layer_id=layer_id,
                        scales=b.scales,
                        wake=False,
                    )
            except (PeerLostError, DeadlineExceededError) as exc:  # the server is gone or stopped
                lost = type(exc)(f"server {self.urls[b.server]} layer {layer_id}: {exc}")
                self.outstanding[b.server] += b.num_tokens
                sent.append(Sent(b.server, -1, b.token_index, pairs, lost))
                continue
            except MoecommError as exc:
                raise type(exc)(f"server {self.urls[b.server]} layer {layer_id}: {exc}") from exc
            self.outstanding[b.server] += b.num_tokens
            sent.append(Sent(b.server, seq, b.token_index, pairs))
        # Wake the servers only once every request is written: a woken server can preempt us
        # on a busy core, and the next server would then start late.
        for s in sent:
            if s.error is None:
                with contextlib.suppress(PeerLostError, DeadlineExceededError):  # found at the wait
                    self.channels[s.server].ring()
        return sent, replica

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer_id: int
    ) -> DispatchHandle:
        """Packs and sends one request per server; returns without waiting."""
        if x.dim() != 2 or x.shape[1] != self.layout.hidden:
            raise ValueError(f"x must be [num_tokens, {self.layout.hidden}], got {list(x.shape)}")
        if x.shape[0] > self.layout.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens exceed max_tokens {self.layout.max_tokens}")
        self._apply_events()
        self.pool.readmit()
        self.pool.refresh_placement()  # a re-placement takes effect between micro-batches
        emap = self._check_routable(layer_id, topk_ids)
        slot = self._take_slot()
        try:
            sent, replica = self._send(slot, layer_id, x, topk_ids, topk_weights, emap)
        except Exception:
            self._busy[slot] = False
            raise
        return DispatchHandle(
            slot, layer_id, x.shape[0], sent, self.out_dtype, replica, x, topk_ids, topk_weights
        )

    def _wait(self, handle: DispatchHandle, sent: Sent, timeout: float) -> torch.Tensor:
        try:
            if sent.error is not None:
                raise sent.error
            if self._watcher is None:
                return self._channel(sent.server).wait(handle.slot, sent.seq, timeout).activations
            # Following a membership: wait in slices so a loss event interrupts the wait.
            deadline = time.monotonic() + timeout
            while True:
                self._apply_events()
                ch = self._channel(sent.server)
                left = deadline - time.monotonic()
                try:
                    return ch.wait(
                        handle.slot, sent.seq, max(0.0, min(left, WAIT_SLICE_S))
                    ).activations
                except DeadlineExceededError:
                    if time.monotonic() >= deadline:
                        raise
        finally:
            self.outstanding[sent.server] -= int(sent.token_index.numel())

    def _channel(self, server: int) -> ClientChannel:
        ch = self.channels[server]
        if ch is None:
            raise PeerLostError(f"server {self.urls[server]} left (membership or removal)")
        return ch

    def combine(
        self,
        handle: DispatchHandle,
        timeout: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Waits for every server of `handle` and sums their partial results in server order,
        straight from the response slots; into `out` ([num_tokens, hidden] of the client's
        out_dtype, caller-owned) when given, else into a new tensor.

        A server that misses the deadline or dies is evicted and its share is re-sent at once
        to replicas (at most MAX_ATTEMPTS attempts, each on servers not tried before); its
        partial takes the failed server's place in the sum. Fails with an error naming the
        expert when no replica is left."""
        if handle.done:
            raise ValueError("this handle was already combined")
        timeout = self.timeout if timeout is None else timeout
        try:
            if self._spare is None:
                partials = self._gather_after_step(handle, timeout)
            else:
                partials = self._gather_at_once(handle, timeout)
            return combine_partials(
                partials,
                [s.token_index for s in handle.sent],
                handle.num_tokens,
                hidden=self.layout.hidden,
                dtype=handle.out_dtype,
                out=out,
                acc=self._acc if out is not None or handle.out_dtype != torch.float32 else None,
            )
        finally:
            handle.done = True
            self._release(handle)
            self._busy[handle.slot] = False

    def _gather_after_step(self, handle: DispatchHandle, timeout: float) -> list:
        """The step's partials, waiting for its servers one after the other; failed shares are
        re-sent once every server answered or failed, into the step's slot."""
        partials, failed = [], []
        for pos, sent in enumerate(handle.sent):
            try:
                partials.append(self._wait(handle, sent, timeout))
            except (DeadlineExceededError, PeerLostError, RemoteError) as exc:
                self._check_resendable(handle, sent, exc)
                partials.append(None)
                failed.append((pos, sent, exc))
        if failed:
            # Retries reuse the slot: own the answers already received, then release it.
            partials = [p.clone() if p is not None else None for p in partials]
            self._release(handle)
            for _, sent, exc in failed:
                self._after_failure(sent.server, exc)
            for pos, sent, exc in failed:
                partials[pos] = self._retry(handle, sent, exc, timeout)
        return partials

    def _check_resendable(self, handle: DispatchHandle, sent: Sent, exc: Exception) -> None:
        """Raises an error answer that a replica would give too (a bad request), naming the
        server; returns for the failures a re-send cures."""
        if isinstance(exc, RemoteError) and exc.status not in _RESEND_STATUSES:
            raise type(exc)(
                exc.status,
                exc.reason,
                f"server {self.urls[sent.server]} layer {handle.layer_id}: ",
            ) from exc

    # ------------------------------------------------------------------ re-send at once
    def _gather_at_once(self, handle: DispatchHandle, timeout: float) -> list:
        """The step's partials. Sleeps on every awaited answer at once; the moment one fails
        (its server died, missed its deadline or refused), that server is evicted and its share
        re-sent to replicas — into their spare slots, while the other answers are awaited."""
        start = time.monotonic()
        state = _Gather(handle, timeout, [None] * len(handle.sent))
        partials, waiting = state.partials, state.waiting
        try:
            for pos, sent in enumerate(handle.sent):
                a = _Await(sent, handle.slot, start + timeout, pos=pos)
                if sent.error is not None:
                    self._fail(state, a, sent.error)
                else:
                    waiting.append(a)
            while waiting:
                if self._watcher is not None:
                    self._apply_events()  # a loss event ends the wait on that server
                gone = [a for a in waiting if self.channels[a.sent.server] is None]
                for a in gone:
                    waiting.remove(a)
                    self._fail(state, a, self._channel_error(a.sent.server))
                if not waiting:
                    break
                left = min(a.deadline for a in waiting) - time.monotonic()
                if self._watcher is not None:
                    left = min(left, WAIT_SLICE_S)
                i, result = self._wait_first(waiting, max(0.0, left))
                if i < 0:
                    now = time.monotonic()
                    for a in [a for a in waiting if a.deadline <= now]:
                        waiting.remove(a)
                        url = self.urls[a.sent.server]
                        late = DeadlineExceededError(
                            f"server {url} slot {a.slot} seq {a.sent.seq}: no response within "
                            f"{timeout:.3f} s"
                        )
                        self._fail(state, a, late)
                    continue
                a = waiting.pop(i)
                if isinstance(result, Exception):
                    self._fail(state, a, result)
                else:
                    self._answered(state, a, result.activations)
                self._send_queued(state)
            if state.queued:  # cannot be: a queued share waits for a spare slot in flight
                raise RuntimeError(f"{len(state.queued)} re-sends never found a free spare slot")
            return partials
        finally:
            for a in waiting:  # abandoned by an error: their late answers will be dropped
                self.outstanding[a.sent.server] -= int(a.sent.token_index.numel())

    def _wait_first(self, waiting: list[_Await], timeout: float) -> tuple[int, object]:
        """wait_first over the awaited answers; with channels on several transports, each
        transport's answers in turn, a slice at a time."""
        chans = [self.channels[a.sent.server] for a in waiting]
        groups: dict[int, list[int]] = {}
        for i, ch in enumerate(chans):
            groups.setdefault(id(ch.transport), []).append(i)
        if len(groups) == 1:
            waits = [(ch, a.slot, a.sent.seq) for ch, a in zip(chans, waiting, strict=True)]
            return wait_first(waits, timeout)
        deadline = time.monotonic() + timeout
        while True:
            for members in groups.values():
                left = max(0.0, min(MIXED_TRANSPORT_SLICE_S, deadline - time.monotonic()))
                j, result = wait_first(
                    [(chans[i], waiting[i].slot, waiting[i].sent.seq) for i in members], left
                )
                if j >= 0:
                    return members[j], result
            if time.monotonic() >= deadline:
                return -1, None

    def _channel_error(self, server: int) -> PeerLostError:
        return PeerLostError(f"server {self.urls[server]} left (membership or removal)")

    def _answered(self, state: _Gather, a: _Await, y: torch.Tensor) -> None:
        self.outstanding[a.sent.server] -= int(a.sent.token_index.numel())
        if a.share is None:
            state.partials[a.pos] = y  # a view into the step's slot, read before its release
            return
        # A spare slot's answer is owned at once: the next re-send to that server reuses it.
        a.share.parts[a.index] = y.float().clone()
        self._release_spare(a.sent.server, state.busy)
        self._share_done(state.partials, a.share)

    def _release_spare(self, server: int, busy: set) -> None:
        busy.discard(server)
        ch = self.channels[server]
        if ch is not None:
            ch.release(self._spare)

    def _fail(self, state: _Gather, a: _Await, exc: Exception) -> None:
        """`a` failed: evict its server, and re-send its pairs to replicas now (or as soon as
        the replica's spare slot is free)."""
        handle = state.handle
        self.outstanding[a.sent.server] -= int(a.sent.token_index.numel())
        self._check_resendable(handle, a.sent, exc)
        if a.share is not None:
            self._release_spare(a.sent.server, state.busy)
        self._after_failure(a.sent.server, exc)
        parent = a.share
        rows = a.sent.token_index if parent is None else parent.rows[a.sent.token_index]
        errors = ([] if parent is None else parent.errors) + [f"{self.urls[a.sent.server]}: {exc}"]
        share = _Share(
            rows,
            a.sent.pairs,
            1 if parent is None else parent.attempt + 1,
            errors,
            parent,
            pos=a.pos,
            index=a.index,
        )
        if share.attempt > MAX_ATTEMPTS:
            raise MoecommError(
                f"layer {handle.layer_id}: {MAX_ATTEMPTS} attempts on distinct replicas failed: "
                + "; ".join(errors)
            ) from exc
        state.queued.append(share)
        self._send_queued(state)

    def _send_queued(self, state: _Gather) -> None:
        """Sends every queued share whose replicas' spare slots are free."""
        queued = state.queued
        for share in list(queued):
            if share not in queued:  # a nested call (a part that failed at once) sent it
                continue
            queued.remove(share)
            if not self._send_share(state, share):
                queued.append(share)

    def _send_share(self, state: _Gather, share: _Share) -> bool:
        """Packs `share` for live replicas and sends each part into its server's spare slot;
        False (nothing sent) while one of those spare slots holds a re-send in flight."""
        handle, busy = state.handle, state.busy
        x = handle.x[share.rows]
        ids = handle.topk_ids[share.rows].masked_fill(~share.pairs, -1)
        weights = handle.topk_weights[share.rows]
        try:
            emap = self._check_routable(handle.layer_id, ids)
        except MoecommError as e:
            raise MoecommError(f"{e}; after failures of " + "; ".join(share.errors)) from e
        replica = self._replicas(emap, handle.layer_id)
        batches = pack_dispatch(x, ids, weights, emap, encoding=self.encoding, replica=replica)
        if any(b.server in busy for b in batches):
            return False
        self.failovers += 1
        share.sent, share.parts = [], [None] * len(batches)
        deadline = time.monotonic() + state.timeout
        fresh = []
        for index, b in enumerate(batches):
            ch = self.channels[b.server]
            pairs = b.expert_ids >= 0
            n = b.num_tokens
            self.outstanding[b.server] += n
            busy.add(b.server)
            try:
                seq = ch.send(
                    self._spare,
                    b.activations,
                    b.expert_ids,
                    b.scores,
                    layer_id=handle.layer_id,
                    scales=b.scales,
                    wake=False,
                )
                sent = Sent(b.server, seq, b.token_index, pairs)
            except (PeerLostError, DeadlineExceededError) as exc:  # gone or stopped
                lost = type(exc)(f"server {self.urls[b.server]} layer {handle.layer_id}: {exc}")
                sent = Sent(b.server, -1, b.token_index, pairs, lost)
            share.sent.append(sent)
            fresh.append(_Await(sent, self._spare, deadline, share=share, index=index))
        for a in fresh:  # wake the replicas once every part is written
            if a.sent.error is None:
                with contextlib.suppress(PeerLostError, DeadlineExceededError):
                    self.channels[a.sent.server].ring()
        if not batches:
            self._share_done(state.partials, share)
        for a in fresh:
            if a.sent.error is not None:
                self._fail(state, a, a.sent.error)
            else:
                state.waiting.append(a)
        return True

    def _share_done(self, partials: list, share: _Share) -> None:
        """Once every part of `share` answered, its partial takes its failed request's place
        (and completes its parent share in turn)."""
        if share.parts is None or any(p is None for p in share.parts):
            return
        y = combine_partials(
            share.parts,
            [s.token_index for s in share.sent],
            int(share.rows.numel()),
            hidden=self.layout.hidden,
            dtype=torch.float32,
        )
        if share.parent is None:
            partials[share.pos] = y
        else:
            share.parent.parts[share.index] = y
            self._share_done(partials, share.parent)

    def _after_failure(self, server: int, exc: Exception) -> None:
        """A stale map is no failure of the server: re-read its table and keep routing to it.
        Anything else takes the server out until it is healthy again."""
        stale = isinstance(exc, RemoteError) and exc.status == int(ResponseStatus.STALE_MAP)
        if stale and self.pool.fetch_placement(server):
            self.pool.rebuild_maps()
            return
        self.evict(server, str(exc))
        if isinstance(exc, PeerOfflineError):
            self.pool.recover_session(server, exc)

    def _release(self, handle: DispatchHandle, sent: list[Sent] | None = None) -> None:
        """Read once, own the copy: the partial results were summed (or cloned) out of the
        response slots of the servers contacted (`sent`, by default the dispatch's), which are
        released here and never read again for this handle."""
        for server in {s.server for s in (handle.sent if sent is None else sent)}:
            ch = self.channels[server]
            if ch is not None:
                ch.release(handle.slot)

    def _retry(
        self, handle: DispatchHandle, failed: Sent, exc: Exception, timeout: float
    ) -> torch.Tensor:
        """Re-sends the (row, k) pairs of a failed request to live replicas; returns their
        summed partial for the rows of the failed request."""
        rows = failed.token_index
        x = handle.x[rows]
        ids = handle.topk_ids[rows].masked_fill(~failed.pairs, -1)
        weights = handle.topk_weights[rows]
        tried = {failed.server}
        errors = [f"{self.urls[failed.server]}: {exc}"]
        for _ in range(MAX_ATTEMPTS):
            self.failovers += 1
            try:
                emap = self._check_routable(handle.layer_id, ids)
            except MoecommError as e:
                raise MoecommError(f"{e}; after failures of " + "; ".join(errors)) from exc
            sent, _ = self._send(handle.slot, handle.layer_id, x, ids, weights, emap)
            parts, bad = [], None
            for s in sent:
                try:
                    parts.append(self._wait(handle, s, timeout))
                except (DeadlineExceededError, PeerLostError, RemoteError) as e:
                    bad = bad or (s, e)
                    self._after_failure(s.server, e)
                    tried.add(s.server)
                    errors.append(f"{self.urls[s.server]}: {e}")
            if bad is None:
                out = combine_partials(
                    parts,
                    [s.token_index for s in sent],
                    rows.numel(),
                    hidden=self.layout.hidden,
                    dtype=torch.float32,
                )
                self._release(handle, sent)  # summed out: a further retry may reuse the slot
                return out
            self._release(handle, sent)
        raise MoecommError(
            f"layer {handle.layer_id}: {MAX_ATTEMPTS} attempts on distinct replicas failed: "
            + "; ".join(errors)
        )

    def _take_slot(self) -> int:
        for i in range(self.num_slots):
            slot = (self._next_slot + i) % self.num_slots
            if not self._busy[slot]:
                self._busy[slot] = True
                self._next_slot = slot + 1
                return slot
        raise RuntimeError(
            f"all {self.num_slots} micro-batch slots are in flight; combine one "
            "before dispatching another"
        )

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        if self._registration is not None:
            self._registration.close(deregister=True)
            self._registration = None
        self.pool.close()
