"""KV hand-offs across hosts, staged: the one case the pool-to-pool transfer
(:mod:`moecomm_serving.disagg.transfer`) cannot serve yet, a prefill and a decode front end that
do not share a host's shared memory (the serving's KV pools are shm only; nixl pools
are to replace this module). The sending side (:class:`KvOutbox`), the receiving side
(:class:`KvInbox`) and the inbox's routes.

A prefill front end whose decode front end refused the pool-to-pool reservation as unreachable
(``409`` from ``/pd/reserve``) gathers the request's held blocks
(:func:`~moecomm_serving.kv.package.pack`), encodes them (:func:`encode_package`) and sends the
bytes with a :class:`KvOutbox`; there a :class:`KvInbox` receives them,
:func:`decode_package` reads them back, and :func:`~moecomm_serving.kv.package.unpack` reserves
blocks in the decode pool and writes them.

The package format (:mod:`moecomm_serving.kv.package`) is ours and carries data only (no
pickle).

The bytes travel over stage channels (:mod:`moecomm.wire.stage`): the prefill side's
:class:`~moecomm.wire.stage.StageSender` writes chunks into the decode side's
:class:`~moecomm.wire.stage.StageReceiver`, which copies each chunk out (read once, own the
copy) and acknowledges it. Each pair speaks the transport :func:`moecomm.wire.choose.choose`
picks, as pipeline stages and expert clients do: shm with a peer on this host's /dev/shm, nixl
otherwise. The connection is set up over HTTP on the decode front end
(:func:`install_kv_routes`): ``GET /pd/kv/offer`` says what it speaks and the slot layout,
``POST /pd/kv/connect`` hands it the sender's region and returns the receiver's and the doorbell's,
``POST /pd/kv/disconnect`` ends a connection whose sender gave up on it (its slots are freed).

One daemon thread per inbox owns every receiver and doorbell, so all transport calls of the
decode side happen on it; ``connect`` and ``take`` hand work to it or wait for its results, each
with a deadline. A sender that dies is dropped alone (a ``take`` of its unfinished package raises
:class:`~moecomm.errors.PeerLostError`); a sender that drops its connection while it lives (its
send failed or ran out of time, or its outbox closed) says so, and the inbox frees that
connection's slots and half-received package; a complete package nobody takes is dropped after
``ttl_s``, so memory stays bounded. A chunk the slot protocol refuses, or one that breaks the
package rules (tags not counting up, one package at a time, a chunk count that changes or
exceeds the largest package, a chunk twice), is answered with the reason, so the sender's send
raises at once with it, and that connection is dropped. The other senders carry on, and a
``take`` of that sender's unfinished package raises :class:`KvTransferError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from moecomm.errors import (
    DeadlineExceededError,
    MoecommError,
    PeerLostError,
    ProtocolError,
)
from moecomm.wire.choose import Doorbells, ShmProbe, TransportSet, boot_id, choose
from moecomm.wire.protocol import PAYLOAD_OFFSET, SlotLayout
from moecomm.wire.shm import reap_stale_segments
from moecomm.wire.stage import MULTI_BELL_POLL_S, Chunk, StageReceiver, StageSender, stage_layout

from moecomm_serving.api.openai import ApiError, read_body
from moecomm_serving.disagg.transfer import KvTransferError
from moecomm_serving.kv.package import KvHandoffError

# Payload bytes of one slot (one chunk). A real model's KV package is tens to hundreds of MB
# (DeepSeek-V3: ~70 KB per token), so chunks are large enough that the per-chunk round trip
# (write, doorbell, copy out, ack: tens of µs) costs a few percent at most, and small enough that
# a decode front end with many prefill peers holds num_slots of them per peer without strain.
KV_SLOT_BYTES = 2 << 20
# Slots per connection: the sender writes the next chunks while the receiver copies one out;
# four keep both sides busy (two would make them alternate on a loaded host).
KV_NUM_SLOTS = 4
# A package is taken within milliseconds of arriving (the router forwards the request to the
# decode front end as soon as the prefill answers); one still unclaimed after a minute belongs to
# a request that failed or went elsewhere, and is dropped so the inbox's memory stays bounded.
UNCLAIMED_KV_TTL_S = 60.0
# Largest package an inbox reassembles: above the KV of the longest context a serving model
# carries (DeepSeek-V3 at 128k tokens is ~9 GB). Bounds what a sender's chunk count can make the
# inbox hold.
KV_MAX_PACKAGE_BYTES = 16 << 30

# Stage channels check each chunk's row width (the layout's `hidden`); KV bytes travel as rows
# of this many f32 elements (4 KiB, a page), so slot_bytes is counted in whole rows.
_KV_ROW_ELEMS = 1024
KV_ROW_BYTES = _KV_ROW_ELEMS * 4
# The header's tag is a u32; a connection that used them all is replaced by a new one.
MAX_TAG = (1 << 32) - 1
# Client ids are random 63-bit numbers (the header holds a u64; 63 bits stay a positive int
# everywhere, JSON readers included); two senders drawing the same one is negligible.
CLIENT_ID_BITS = 63
MAX_CLIENT_ID = (1 << 64) - 1

# Longest sleep of the inbox's thread before it looks at its command queue (a connect waits at
# most this long to be picked up) and its senders' liveness.
LOOP_SLICE_S = 0.05
# How often the inbox checks that its senders live and drops unclaimed packages: a dead sender
# never rings, and one dying while others keep the doorbell busy must be noticed too. An shm
# sender is checked every time (a kill(pid, 0)).
HOUSEKEEPING_S = 0.1
# A nixl sender's check is a remote read that a stopped or unreachable peer holds for up to 2 s
# (the transport's probe deadline) on the inbox's one thread, so it is probed only when silent:
# this long without a chunk while one of its packages is incomplete (its memory is held), ...
NIXL_BUSY_PROBE_S = 1.0
# ... and this long without a chunk otherwise (only its connection's slots are held).
NIXL_IDLE_PROBE_S = 10.0
# With doorbells on two transports the thread polls them; the period starts at the stage
# inbox's (chunks of a package follow each other closely) and doubles up to this while nothing
# rings, so an idle decode front end does not spend a core on polling.
MULTI_BELL_IDLE_POLL_S = 1e-3
# A connect is one region attach (for nixl: a metadata exchange with the sender's host).
CONNECT_TIMEOUT_S = 30.0
# The inbox's thread sets up its transports (nixl: an agent) before start() returns.
START_TIMEOUT_S = 60.0
# close() waits this long for the thread to release its receivers.
CLOSE_TIMEOUT_S = 10.0
# The connect request's body: a transport name, a region handle and a number (a disconnect's:
# the number alone).
MAX_CONNECT_BODY_BYTES = 64 << 10
# A disconnect is one queued command on the inbox's thread, which picks commands up every
# LOOP_SLICE_S; this bounds a caller's wait when the thread is stuck in a slow liveness probe.
DISCONNECT_TIMEOUT_S = 10.0
# The outbox tells a decode side that it dropped a connection on the way out of a failure, so
# the wait is short: a decode side that is gone or stopped would otherwise add its full deadline
# to the failure; one that misses the word frees the slots when the sender's process ends.
DISCONNECT_NOTICE_TIMEOUT_S = 1.0
# The outbox's default deadline for a whole send (connect, every chunk written and acknowledged).
DEFAULT_SEND_TIMEOUT_S = 30.0

NOT_SERVING = "this server takes no KV hand-offs"


# ---------------------------------------------------------------------------------- the format
def kv_layout(slot_bytes: int) -> SlotLayout:
    """The stage-channel layout whose chunks carry `slot_bytes` (whole 4 KiB rows)."""
    if not isinstance(slot_bytes, int) or slot_bytes < KV_ROW_BYTES:
        raise ValueError(f"slot_bytes must be an int >= {KV_ROW_BYTES}, got {slot_bytes!r}")
    return stage_layout(slot_bytes // KV_ROW_BYTES, _KV_ROW_ELEMS, "f32")


def _check_client_id(client_id) -> None:
    if not isinstance(client_id, int) or isinstance(client_id, bool):
        raise KvHandoffError(f"client_id must be an int, got {client_id!r:.40}")
    if not 0 <= client_id <= MAX_CLIENT_ID:
        raise KvHandoffError(f"client_id must be in [0, 2^64), got {client_id}")


@dataclass
class _Conn:
    """One prefill sender's connection, owned by the inbox's thread."""

    receiver: StageReceiver
    transport: str
    heard: float = field(default_factory=time.monotonic)  # last chunk, or last liveness check
    # The package rules' view, kept by the check each chunk's header passes before the chunk is
    # taken (KvInbox._admit), so that a refusal reaches the sender with its reason:
    last_tag: int = 0  # tags count up per connection: a smaller or equal one is a replay
    open_tag: int = 0  # the package whose chunks are being admitted (0: none)
    open_count: int = 0  # its chunk count
    open_seen: set = field(default_factory=set)  # its chunk indices admitted so far
    # The package being reassembled from admitted chunks (0: none), its parts, how many are due
    # and the bytes they hold so far:
    tag: int = 0
    parts: list = field(default_factory=list)
    missing: int = 0
    held: int = 0


@dataclass
class _Command:
    """A connect or disconnect handed to the inbox's thread; the caller waits on `done`."""

    action: str  # "connect" or "disconnect"
    args: tuple
    done: threading.Event = field(default_factory=threading.Event)
    state: str = "pending"  # pending -> running -> done, or cancelled by a caller out of time
    result: dict | None = None
    error: BaseException | None = None


class KvInbox:
    """The decode side: receives KV packages from any number of prefill front ends.

    `transport`: "shm", "nixl" or "auto" (what it offers; each sender picks); `host`: the address
    nixl carries bytes over; `slot_bytes` x `num_slots`: each connection's data ring (memory held
    per prefill peer); `ttl_s`: how long a complete package waits to be taken;
    `max_package_bytes`: the largest package it reassembles (a sender announcing more chunks is
    refused)."""

    def __init__(
        self,
        transport: str = "auto",
        host: str | None = None,
        slot_bytes: int = KV_SLOT_BYTES,
        num_slots: int = KV_NUM_SLOTS,
        ttl_s: float = UNCLAIMED_KV_TTL_S,
        max_package_bytes: int = KV_MAX_PACKAGE_BYTES,
    ):
        self.layout = kv_layout(slot_bytes)
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self.spec, self.host = transport, host
        self.num_slots, self.ttl_s = num_slots, float(ttl_s)
        self.capacity = self.layout.request_slot_bytes - PAYLOAD_OFFSET  # bytes per chunk
        self._max_chunks = -(-max_package_bytes // self.capacity)
        self._cv = threading.Condition()
        self._ready: dict[tuple[int, int], tuple[torch.Tensor, float]] = {}
        self._gone: dict[int, tuple[type, str, float]] = {}  # dropped sender -> (error, why, when)
        self._stats = dict.fromkeys(
            (
                "packages",
                "bytes",
                "refused",
                "senders_lost",
                "disconnected",
                "expired",
                "connected",
                "in_progress",
                "in_progress_bytes",
            ),
            0,
        )
        self._commands: deque[_Command] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._failure: BaseException | None = None
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._offer: dict | None = None
        # Owned by the thread:
        self._transports: TransportSet | None = None
        self._probe: ShmProbe | None = None
        self._conns: dict[int, _Conn] = {}
        self._bells: dict[str, Doorbells] = {}

    # ------------------------------------------------------------------ public, any thread
    def start(self) -> KvInbox:
        if self._thread is not None:
            raise RuntimeError("KV inbox: started twice")
        self._thread = threading.Thread(target=self._run, name="kv-inbox", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise DeadlineExceededError(f"KV inbox: not set up within {START_TIMEOUT_S} s")
        if self._failure is not None:
            raise KvTransferError(f"KV inbox: set-up failed: {self._failure}") from self._failure
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def offer(self) -> dict:
        """What a sender needs to pick a transport and size its channel."""
        if self._offer is None:
            raise RuntimeError("KV inbox: offer() before start()")
        return dict(self._offer)

    def connect(self, transport: str, sender_handle: str, client_id: int) -> dict:
        """Attaches a sender's region (on the inbox's thread); returns the handles the sender
        connects to. Raises KvHandoffError when refused (a transport not offered, a client id
        already connected and alive, a region that cannot be attached), DeadlineExceededError
        when the inbox's thread does not get to it in time, KvTransferError when it is closed."""
        if not isinstance(transport, str) or transport not in self.offer()["transports"]:
            raise KvHandoffError(
                f"transport {transport!r:.40} is not offered here (this server offers "
                f"{', '.join(self.offer()['transports'])})"
            )
        if not isinstance(sender_handle, str) or not sender_handle:
            raise KvHandoffError(
                f"sender must be a region handle string, got {sender_handle!r:.80}"
            )
        _check_client_id(client_id)
        return self._submit(_Command("connect", (transport, sender_handle, client_id)))

    def disconnect(self, client_id: int) -> bool:
        """Drops sender `client_id`'s connection (on the inbox's thread): its slots and its
        unfinished package are freed, a ``take`` of that package raises KvTransferError;
        complete packages stay until taken or expired. Returns whether it was connected.
        Raises DeadlineExceededError when the thread does not get to it in time,
        KvTransferError when the inbox is closed."""
        _check_client_id(client_id)
        return self._submit(_Command("disconnect", (client_id,)), DISCONNECT_TIMEOUT_S)

    def _submit(self, cmd: _Command, timeout: float = CONNECT_TIMEOUT_S):
        """Hands `cmd` to the inbox's thread and waits up to `timeout` for its result."""
        with self._cv:
            self._check_running()
            self._commands.append(cmd)
        self._wake.set()
        if not cmd.done.wait(timeout):
            with self._cv:
                late = cmd.state != "done"
                if late:  # a pending one is skipped, a running connect undone when it finishes
                    cmd.state = "cancelled"
            if late:
                raise DeadlineExceededError(
                    f"KV inbox: {cmd.action} of client {cmd.args[-1]} not done within {timeout} s"
                )
        if cmd.error is not None:
            raise cmd.error
        return cmd.result

    def take(self, client_id: int, tag: int, timeout: float) -> torch.Tensor:
        """Package `tag` of sender `client_id`, once complete (uint8 bytes, ours to keep).
        Raises DeadlineExceededError when it is not there within `timeout` seconds, and
        PeerLostError (KvTransferError: its connection was refused) when its sender is gone."""
        for name, v in (("client_id", client_id), ("tag", tag)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"KV inbox take: {name} must be an int, got {v!r:.40}")
        deadline = time.monotonic() + timeout
        key = (client_id, tag)
        with self._cv:
            while True:
                item = self._ready.pop(key, None)
                if item is not None:
                    return item[0]
                gone = self._gone.get(client_id)
                if gone is not None:
                    error, why, _ = gone
                    raise error(f"KV package {tag} from client {client_id} will not come: {why}")
                self._check_running()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceededError(
                        f"KV package {tag} from client {client_id} did not arrive within "
                        f"{timeout:.3f} s"
                    )
                self._cv.wait(remaining)

    @property
    def stats(self) -> dict:
        """Counters: `packages` and `bytes` completed, `refused` connections (a chunk broke a
        rule), `senders_lost` (died), `disconnected` (their sender dropped them), `expired`
        packages; gauges: `connected` senders, `in_progress` packages and the
        `in_progress_bytes` their chunks hold so far."""
        with self._cv:
            return dict(self._stats)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(CLOSE_TIMEOUT_S)

    def __enter__(self) -> KvInbox:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_running(self) -> None:
        """Raises when the inbox can serve nobody (caller holds the lock)."""
        if self._failure is not None:
            raise KvTransferError(f"KV inbox: its thread failed: {self._failure}")
        if self._stop:
            raise KvTransferError("KV inbox: closed")

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self._setup()
        except BaseException as e:
            self._failure = e
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        except BaseException as e:  # reported to every waiter, not lost in a thread
            with self._cv:
                self._failure = e
                self._cv.notify_all()
        finally:
            self._teardown()

    def _setup(self) -> None:
        self._transports = TransportSet(self.spec, host=self.host)
        names = list(self._transports.names)
        offer = {"transports": names, "boot_id": boot_id()}
        if "shm" in names:
            self._probe = ShmProbe(self._transports.get("shm"))
            offer["shm_probe"] = self._probe.describe()
        offer.update(layout=self.layout.to_dict(), num_slots=self.num_slots)
        self._offer = offer

    def _loop(self) -> None:
        next_housekeeping = 0.0
        while not self._stop:
            self._wake.clear()
            self._run_commands()
            seen = {n: b.values() for n, b in self._bells.items()}
            progressed = self._poll_all()
            now = time.monotonic()
            if now >= next_housekeeping:
                self._check_senders(now)
                self._expire(now)
                next_housekeeping = now + HOUSEKEEPING_S
            if progressed or self._commands or self._stop:
                continue
            self._sleep(seen, max(0.0, min(LOOP_SLICE_S, next_housekeeping - now)))

    def _sleep(self, seen: dict, timeout: float) -> None:
        """Until a doorbell rings (data), a command comes, or `timeout` passes."""
        if not self._bells:
            self._wake.wait(timeout)
        elif len(self._bells) == 1:
            ((name, bells),) = self._bells.items()
            bells.wait(seen[name], timeout)
        else:  # a remote write cannot wake a sleeper: poll every transport's bell
            deadline = time.monotonic() + timeout
            period = MULTI_BELL_POLL_S
            while time.monotonic() < deadline and not self._wake.is_set():
                if any(b.values() != seen[n] for n, b in self._bells.items()):
                    return
                time.sleep(period)
                period = min(2 * period, MULTI_BELL_IDLE_POLL_S)

    def _run_commands(self) -> None:
        while True:
            with self._cv:
                if not self._commands:
                    return
                cmd = self._commands.popleft()
                if cmd.state == "cancelled":
                    continue
                cmd.state = "running"
            run = self._connect if cmd.action == "connect" else self._disconnect
            try:
                result, error = run(*cmd.args), None
            except BaseException as e:
                result, error = None, e
            with self._cv:
                cancelled = cmd.state == "cancelled"
                cmd.result, cmd.error, cmd.state = result, error, "done"
            if cancelled and cmd.action == "connect" and result is not None:
                self._drop(cmd.args[2], None, "")  # nobody will hand it to the sender
            cmd.done.set()

    def _connect(self, transport: str, sender_handle: str, client_id: int) -> dict:
        old = self._conns.get(client_id)
        if old is not None:
            if old.receiver.peer_alive():
                raise KvHandoffError(f"client id {client_id} is already connected")
            self._drop(client_id, PeerLostError, "the sender process died")
        t = self._transports.get(transport)
        if transport not in self._bells:
            self._bells[transport] = Doorbells(TransportSet(t))
        r = StageReceiver(t, self.layout, client_id, self.num_slots, f"kv<-{client_id}")
        try:
            r.connect(sender_handle)
        except (MoecommError, ValueError, RuntimeError) as e:
            r.close()
            raise KvHandoffError(
                f"cannot attach the sender's region {sender_handle!r:.80}: {e}"
            ) from None
        self._conns[client_id] = _Conn(r, transport)
        with self._cv:
            self._gone.pop(client_id, None)
            self._stats["connected"] = len(self._conns)
        return {"receiver": r.handle, "doorbell": self._bells[transport].handle(transport)}

    def _disconnect(self, client_id: int) -> bool:
        if client_id not in self._conns:
            return False
        self._drop(client_id, KvTransferError, "its sender dropped the connection")
        with self._cv:
            self._stats["disconnected"] += 1
        return True

    def _poll_all(self) -> bool:
        """Takes every chunk there; returns whether any came."""
        progressed = False
        for cid, conn in list(self._conns.items()):
            try:
                chunks = conn.receiver.poll(lambda h, conn=conn: self._admit(conn, h))
                if chunks:
                    conn.heard = time.monotonic()
                for c in chunks:
                    self._add_chunk(cid, conn, c)
            except PeerLostError as e:
                self._drop(cid, PeerLostError, str(e))
                continue
            except (ProtocolError, MoecommError) as e:  # refused: that sender alone is dropped
                with self._cv:
                    self._stats["refused"] += 1
                self._drop(cid, KvTransferError, f"its connection was refused: {e}")
                continue
            progressed = progressed or bool(chunks)
        return progressed

    def _admit(self, conn: _Conn, h) -> str | None:
        """The package rules, checked on a chunk's header before it is taken: None admits it
        (and records it), a reason refuses it (the sender's send raises with it)."""
        tag, index, count = h.layer_id, h.num_tokens, h.topk  # the slot protocol's 0 <= i < n
        if conn.open_tag == 0:
            if tag <= conn.last_tag:
                return f"package {tag} after package {conn.last_tag}: tags go up on a connection"
            if count > self._max_chunks:
                return (
                    f"package {tag} of {count} chunks exceeds the {self._max_chunks} chunks of "
                    "the largest KV package"
                )
            conn.open_tag, conn.open_count, conn.open_seen = tag, count, set()
        elif tag != conn.open_tag or count != conn.open_count:
            return (
                f"package {tag} chunk {index}/{count} while package {conn.open_tag} "
                f"({conn.open_count} chunks) is incomplete: one package at a time"
            )
        if index in conn.open_seen:
            return f"package {tag} chunk {index} came twice"
        conn.open_seen.add(index)
        if len(conn.open_seen) == conn.open_count:
            conn.last_tag, conn.open_tag, conn.open_seen = tag, 0, set()
        return None

    def _add_chunk(self, cid: int, conn: _Conn, c: Chunk) -> None:
        """Places an admitted chunk: _admit let through only chunks of one package at a time,
        each once, in the order poll() returns them."""
        if conn.tag == 0:
            conn.tag, conn.parts, conn.missing = c.tag, [None] * c.count, c.count
            with self._cv:
                self._stats["in_progress"] += 1
        conn.parts[c.index] = c.data
        conn.missing -= 1
        if conn.missing:
            conn.held += c.data.numel()
            with self._cv:
                self._stats["in_progress_bytes"] += c.data.numel()
            return
        data = torch.cat(conn.parts) if len(conn.parts) > 1 else conn.parts[0]
        tag, held, conn.tag, conn.parts, conn.held = conn.tag, conn.held, 0, [], 0
        with self._cv:
            self._ready[(cid, tag)] = (data, time.monotonic())
            self._stats["packages"] += 1
            self._stats["bytes"] += data.numel()
            self._stats["in_progress"] -= 1
            self._stats["in_progress_bytes"] -= held
            self._cv.notify_all()

    def _check_senders(self, now: float) -> None:
        for cid, conn in list(self._conns.items()):
            if conn.transport != "shm":
                silent = NIXL_BUSY_PROBE_S if conn.tag else NIXL_IDLE_PROBE_S
                if now - conn.heard < silent:
                    continue
                conn.heard = now
            if not conn.receiver.peer_alive():
                self._drop(cid, PeerLostError, "the sender process died")

    def _drop(self, cid: int, error: type | None, why: str) -> None:
        """Forgets sender `cid`; waiters for its unfinished packages get `error` (None: a
        connection nobody used)."""
        conn = self._conns.pop(cid, None)
        if conn is not None:
            conn.receiver.close()
            if conn.transport == "shm":
                reap_stale_segments()  # a dead sender's own segments stay in /dev/shm otherwise
        with self._cv:
            if conn is not None and conn.tag:
                self._stats["in_progress"] -= 1
                self._stats["in_progress_bytes"] -= conn.held
            if error is not None:
                if error is PeerLostError:
                    self._stats["senders_lost"] += 1
                self._gone[cid] = (error, why, time.monotonic())
            self._stats["connected"] = len(self._conns)
            self._cv.notify_all()

    def _expire(self, now: float) -> None:
        with self._cv:
            for key in [k for k, (_, t) in self._ready.items() if now - t > self.ttl_s]:
                del self._ready[key]
                self._stats["expired"] += 1
            for cid in [c for c, (_, _, t) in self._gone.items() if now - t > self.ttl_s]:
                del self._gone[cid]

    def _teardown(self) -> None:
        for cid in list(self._conns):
            with contextlib.suppress(Exception):
                self._drop(cid, None, "")
        for bells in self._bells.values():
            bells.close()
        if self._probe is not None:
            self._probe.close()
        with self._cv:
            self._stop = True
            pending, self._commands = list(self._commands), deque()
            self._cv.notify_all()
        for cmd in pending:
            cmd.error = KvTransferError("KV inbox: closed")
            cmd.done.set()


# ---------------------------------------------------------------------------------- the outbox
@dataclass
class _Peer:
    """The outbox's connection to one decode front end."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sender: StageSender | None = None
    transport: str = ""
    next_tag: int = 1


class KvOutbox:
    """The prefill side: one sender per decode front end, connected on first use.

    `transport`: "shm", "nixl" or "auto"; `host`: the address nixl carries bytes over;
    `timeout_s`: a send's default deadline, connect included."""

    def __init__(
        self,
        transport: str = "auto",
        host: str | None = None,
        timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    ):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.transports = TransportSet(transport, host=host)
        self.timeout_s = float(timeout_s)
        self._http = httpx.Client()
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._closed = False

    def send(
        self, decode_url: str, data: torch.Tensor, timeout: float | None = None
    ) -> tuple[int, int]:
        """Sends `data`'s bytes to the KV inbox at `decode_url`; returns (client_id, tag), what
        its take() needs, once every chunk was acknowledged."""
        if not isinstance(data, torch.Tensor) or data.device.type != "cpu" or data.numel() == 0:
            raise ValueError("KV hand-off data must be a non-empty CPU tensor")
        timeout = self.timeout_s if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        url = decode_url.rstrip("/")
        with self._lock:
            if self._closed:
                raise KvTransferError("KV outbox: closed")
            peer = self._peers.setdefault(url, _Peer())
        if not peer.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise KvTransferError(
                f"KV hand-off to {url}: earlier sends held its connection past the deadline"
            )
        try:
            try:
                if peer.sender is not None and peer.next_tag > MAX_TAG:
                    self._drop(url, peer)  # every tag used: a new connection starts at 1 again
                if peer.sender is None:
                    self._connect(url, peer, deadline)
                tag, peer.next_tag = peer.next_tag, peer.next_tag + 1
                # The layout's encoding, whatever `data`'s dtype: the chunks are bytes (an int8
                # tensor's own encoding is a quantized one, which stage channels refuse).
                enc = peer.sender.layout.encoding
                peer.sender.send(tag, data, self._remaining(deadline, url), encoding=enc)
                peer.sender.flush(self._remaining(deadline, url))
                return peer.sender.client_id, tag
            except (MoecommError, httpx.HTTPError, OSError, KeyError, TypeError, ValueError) as e:
                self._drop(url, peer)
                if isinstance(e, KvTransferError):
                    raise
                raise KvTransferError(
                    f"KV hand-off to {url} failed: {type(e).__name__}: {e}"
                ) from e
            except BaseException:  # a half-sent package leaves the connection unusable
                self._drop(url, peer)
                raise
        finally:
            peer.lock.release()

    def connected(self) -> dict[str, str]:
        """The decode front ends connected now, with the transport each speaks."""
        with self._lock:
            return {u: p.transport for u, p in self._peers.items() if p.sender is not None}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers = list(self._peers.items())
        for url, peer in peers:
            with peer.lock:
                self._drop(url, peer)
        self._http.close()

    def __enter__(self) -> KvOutbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _remaining(deadline: float, url: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(f"KV hand-off to {url}: out of time")
        return left

    def _call(self, method: str, url: str, deadline: float, body: dict | None = None) -> dict:
        r = self._http.request(method, url, json=body, timeout=self._remaining(deadline, url))
        try:
            answer = r.json()
        except ValueError:
            answer = None
        if r.status_code != 200 or not isinstance(answer, dict):
            msg = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
            raise KvTransferError(
                f"KV hand-off: {method} {url} answered {r.status_code}: {msg or r.text[:200]}"
            )
        return answer

    def _connect(self, url: str, peer: _Peer, deadline: float) -> None:
        offer = self._call("GET", f"{url}/pd/kv/offer", deadline)
        name = choose(self.transports, offer, url)
        try:
            layout = SlotLayout.from_dict(offer["layout"])
            num_slots = int(offer["num_slots"])
        except (KeyError, TypeError, ValueError) as e:
            raise KvTransferError(f"KV hand-off: {url} offered a malformed layout: {e}") from None
        t = self.transports.get(name)
        cid = secrets.randbits(CLIENT_ID_BITS)
        sender = StageSender(t, layout, cid, num_slots, f"kv->{url}")
        try:
            body = {"transport": name, "sender": sender.handle, "client_id": cid}
            handles = self._call("POST", f"{url}/pd/kv/connect", deadline, body)
            sender.connect(str(handles["receiver"]), str(handles["doorbell"]))
        except BaseException:
            sender.close()
            raise
        peer.sender, peer.transport, peer.next_tag = sender, name, 1

    def _drop(self, url: str, peer: _Peer) -> None:
        """Forgets the connection to `url` (caller holds its lock) and tells the decode side,
        best effort: while this process lives, an shm receiver sees its sender alive and would
        hold the connection's slots (and any half-received package) until this process ends."""
        sender, peer.sender, peer.transport = peer.sender, None, ""
        if sender is None:
            return
        with contextlib.suppress(Exception):
            sender.close()
        # An unknown id (the decode side dropped it first: it refused a chunk, or it restarted)
        # or no answer (it is gone) leaves nothing to do.
        with contextlib.suppress(httpx.HTTPError, OSError):
            self._http.post(
                f"{url}/pd/kv/disconnect",
                json={"client_id": sender.client_id},
                timeout=DISCONNECT_NOTICE_TIMEOUT_S,
            )


# ---------------------------------------------------------------------------------- routes
def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(ApiError(status, message).body(), status)


async def _json_fields(request: Request, want: dict[str, type], what: str) -> dict | JSONResponse:
    """The body of a KV set-up request: a JSON object with exactly the fields of `want`, each of
    its type (an int is never a bool); else the 400 (or 413) answering it."""
    try:
        raw = await read_body(request, MAX_CONNECT_BODY_BYTES)
    except ApiError as e:
        return _error(e.status, e.message)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return _error(400, f"the KV {what} body is not JSON: {e}")
    if not isinstance(body, dict) or set(body) != set(want):
        got = sorted(body) if isinstance(body, dict) else type(body).__name__
        return _error(400, f"the KV {what} body has exactly the fields {sorted(want)}, got {got}")
    for key, kind in want.items():
        if not isinstance(body[key], kind) or isinstance(body[key], bool):
            kind_name = "an integer" if kind is int else "a string"
            return _error(400, f"the KV {what} field {key!r} must be {kind_name}")
    return body


def install_kv_routes(app: FastAPI, inbox_getter: Callable[[], KvInbox | None]) -> None:
    """``GET /pd/kv/offer``, ``POST /pd/kv/connect`` and ``POST /pd/kv/disconnect`` on `app`,
    served by the inbox `inbox_getter()` returns (None: this server takes no hand-offs, 404)."""

    @app.get("/pd/kv/offer")
    async def kv_offer():
        inbox = inbox_getter()
        if inbox is None:
            return _error(404, NOT_SERVING)
        return inbox.offer()

    @app.post("/pd/kv/connect")
    async def kv_connect(request: Request):
        inbox = inbox_getter()
        if inbox is None:
            return _error(404, NOT_SERVING)
        want = {"transport": str, "sender": str, "client_id": int}
        body = await _json_fields(request, want, "connect")
        if isinstance(body, JSONResponse):
            return body
        try:
            return await asyncio.to_thread(
                inbox.connect, body["transport"], body["sender"], body["client_id"]
            )
        except KvHandoffError as e:
            return _error(400, str(e))
        except MoecommError as e:  # the inbox is closed, failed or out of time
            return _error(503, f"KV inbox: {e}")

    @app.post("/pd/kv/disconnect")
    async def kv_disconnect(request: Request):
        inbox = inbox_getter()
        if inbox is None:
            return _error(404, NOT_SERVING)
        body = await _json_fields(request, {"client_id": int}, "disconnect")
        if isinstance(body, JSONResponse):
            return body
        cid = body["client_id"]
        try:
            found = await asyncio.to_thread(inbox.disconnect, cid)
        except KvHandoffError as e:
            return _error(400, str(e))
        except MoecommError as e:  # the inbox is closed, failed or out of time
            return _error(503, f"KV inbox: {e}")
        if not found:
            return _error(404, f"KV client {cid} is not connected here")
        return {"client_id": cid, "disconnected": True}
