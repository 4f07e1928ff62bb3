"""An emulated network link for benchmarks: expert servers whose clients sit `delay` away.

Benchmarks only; the library never imports this. A `DelayedLink(delay_s)` is the
`channel_factory` of an `ExpertServer`: every client connection gets a `DelayedChannel`, a
`ServerChannel` that

- shows a request to the server only `delay` after it first saw it in REQUEST_READY (the time
  the request spent on the wire), and
- writes an answer into the client's memory `delay` after the server gave it (the time the
  answer spends on the wire).

Requests and answers in flight overlap their delays, as on a real link. One timer thread per
link writes the answers when they are due and wakes the server (`ExpertServer.wake`) when a held
request becomes due: the server sleeps on its doorbell and would otherwise notice it only at its
idle wake-up. Error answers (`reject`) travel the link like results: the client learns of a
refusal no sooner than it would across a real network, and every message leaving the server
goes through the same FIFO of equal delays, so they stay in order.

Thread safety: the timer thread answers (releases a request slot, writes the client's response
slot) while the server thread polls every slot of the same channel. The C++ calls touch only the
slot they are given, but a poll that reads a slot at the moment it is released (in poison mode
it is being overwritten) would see a half-written request whose key is no longer held back. So a
lock per channel serializes polls, delayed answers and closing; both sides hold it for a few
microseconds (a header scan, or one memcpy of an answer).

`spawn_delayed_server` starts such a server in its own process, as
`moecomm.runtime.launch.spawn_expert_server` does without a link.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

import torch
from moecomm.runtime.control import HttpServer, make_app
from moecomm.runtime.launch import (
    ModelSpec,
    ServerProcess,
    start_server_process,
    wait_for_stop,
)
from moecomm.runtime.server import ExpertServer
from moecomm.wire.protocol import ENCODING_DTYPE
from moecomm.wire.server import Request, ServerChannel

log = logging.getLogger("bench.delayed_link")


class DelayedLink:
    """The channel factory of one server, and the timer thread of its delayed events."""

    def __init__(self, delay_s: float):
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.delay = delay_s
        self._server: ExpertServer | None = None
        self._events: list[tuple[float, int, Callable[[], None]]] = []  # heap by due time
        self._order = itertools.count()  # ties keep the order of scheduling
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="delayed-link", daemon=True)
        self._thread.start()

    def __call__(self, transport, layout, client_id, num_slots, name: str = "client"):
        return DelayedChannel(self, transport, layout, client_id, num_slots, name=name)

    def bind(self, server: ExpertServer) -> None:
        """The server to wake when a held request becomes due. Until bound, held requests are
        noticed at the server's idle wake-up only."""
        self._server = server

    def schedule(self, due: float, fn: Callable[[], None]) -> None:
        with self._cv:
            if self._closed:
                return
            heapq.heappush(self._events, (due, next(self._order), fn))
            self._cv.notify()

    def wake_server(self) -> None:
        if self._server is not None:
            self._server.wake()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed:
                    if self._events:
                        wait = self._events[0][0] - time.monotonic()
                        if wait <= 0:
                            break
                        self._cv.wait(wait)
                    else:
                        self._cv.wait()
                if self._closed:
                    return
                _, _, fn = heapq.heappop(self._events)
            try:
                fn()
            except Exception:  # one lost message must not stop the link
                log.exception("delayed link: a delayed event failed")

    def close(self, timeout: float = 5.0) -> None:
        """Stops the timer thread; events not yet due are dropped (their clients time out)."""
        with self._cv:
            self._closed = True
            self._events.clear()
            self._cv.notify()
        self._thread.join(timeout)


class DelayedChannel(ServerChannel):
    """A ServerChannel behind `link`: see the module docstring."""

    def __init__(self, link: DelayedLink, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._link = link
        self._lock = threading.Lock()
        self._closed = False
        # (slot, seq) -> monotonic time the request was first seen ready, until it is answered.
        self._first_seen: dict[tuple[int, int], float] = {}
        # (slot, seq) answered by the server, the answer still on the link: the request stays
        # REQUEST_READY until the answer is written, and must not be served twice.
        self._in_flight: set[tuple[int, int]] = set()

    def poll(self) -> list[Request]:
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return []
            ready = super().poll()
            seen: dict[tuple[int, int], float] = {}
            due: list[Request] = []
            for req in ready:
                key = (req.slot, req.seq)
                if key in self._in_flight:
                    continue
                first = self._first_seen.get(key)
                if first is None:
                    first = now
                    if self._link.delay > 0:
                        self._link.schedule(now + self._link.delay, self._link.wake_server)
                seen[key] = first
                if now - first >= self._link.delay:
                    due.append(req)
            # Keys no longer ready (the client overwrote a slot it gave up on) are forgotten.
            self._first_seen = seen
        return due

    def _check_answer(self, req: Request, y: torch.Tensor) -> None:
        # What ServerChannel.respond checks, done now: the server hears of a bad answer at
        # once (and rejects instead), not in the timer thread.
        dtype = ENCODING_DTYPE[self.layout.out_encoding]
        shape = (req.num_tokens, self.layout.hidden)
        if not isinstance(y, torch.Tensor) or y.device.type != "cpu":
            raise TypeError("y must be a CPU torch.Tensor")
        if tuple(y.shape) != shape or y.dtype != dtype:
            raise ValueError(f"y must be {dtype} {list(shape)}, got {y.dtype} {list(y.shape)}")

    def _send_later(self, req: Request, send: Callable[[], None]) -> None:
        key = (req.slot, req.seq)
        with self._lock:
            self._first_seen.pop(key, None)
            self._in_flight.add(key)
        # Released as far as the server is concerned (its activations were consumed); the slot
        # itself is released when the answer is written.
        req.activations = None

        def deliver() -> None:
            with self._lock:
                try:
                    if not self._closed:
                        send()
                finally:
                    self._in_flight.discard(key)

        self._link.schedule(time.monotonic() + self._link.delay, deliver)

    def respond(self, req: Request, y: torch.Tensor) -> None:
        self._check_answer(req, y)
        y = y.detach().clone()  # own copy: y may be a view of the request slot
        self._send_later(req, lambda: ServerChannel.respond(self, req, y))

    def reject(self, req: Request, status=None, reason: str | None = None) -> None:
        self._send_later(req, lambda: ServerChannel.reject(self, req, status, reason))

    def announce_offline(self) -> None:
        with self._lock:
            if not self._closed:
                super().announce_offline()

    def mark_offline(self) -> None:
        with self._lock:
            if not self._closed:
                super().mark_offline()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._in_flight.clear()
            self._first_seen.clear()
        super().close()


# ---------------------------------------------------------------------- a server process
def _serve(conn, spec: ModelSpec, hosted: dict, server_id: str, delay_s: float) -> None:
    torch.set_num_threads(1)
    all_experts = spec.experts()
    experts = {layer: {e: all_experts[layer][e] for e in ids} for layer, ids in hosted.items()}
    link = DelayedLink(delay_s)
    server = ExpertServer(experts, server_id, channel_factory=link)
    link.bind(server)
    http = HttpServer(make_app(server))
    server.start()
    conn.send(http.start())
    wait_for_stop(conn, server)
    http.stop()
    link.close()  # first: its timer thread must not ring the doorbell of a closed server
    server.close()


def spawn_delayed_server(
    spec: ModelSpec, hosted: dict[int, list[int]], server_id: str, delay_s: float
) -> ServerProcess:
    """An expert server process whose clients are `delay_s` away (each way)."""
    return start_server_process(_serve, (spec, hosted, server_id, delay_s), server_id)
