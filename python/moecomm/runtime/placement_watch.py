"""The placement controller's redundancy watch: while the controller runs, it re-reads the
servers' tables when something changed and re-homes an expert below its copies at once, without
waiting for the next load-driven pass.

Something changed: a server lost (the idle TCP connection the watch holds to its control port
closes, or stops answering the kernel's keep-alive probes, and a new one is refused), a server
back or added (the server list changed), or, as a safety net for tables changed by someone
else, every `safety_poll_s`. An idle watch reads no table between safety polls: with S servers
the old watch's S/`watch_s` reads a second (one read outlasts 0.1 s from ~100 servers,
docs/scale.md) become S/`safety_poll_s`. notified=False keeps the old watch (every table every
`watch_s`), for the benchmarks.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence

import httpx

from moecomm.runtime.placement_views import RebalanceReport

log = logging.getLogger("moecomm.placement")

# How often the running controller checks that every expert still has its copies (a GET
# /experts of each server without its load table, a few ms): the detection part of the time
# from a server's loss to restored redundancy. A killed server refuses the next connect at once.
REDUNDANCY_WATCH_S = 0.1
# The notified watch's safety poll: every table is re-read this often even with no event, for
# tables changed by someone other than this controller (a second controller, an operator's
# `moecomm` command). Losses and joins do not wait for it.
SAFETY_POLL_S = 10.0
# ...and at most this many of its table reads a second over all servers (~1.4 ms of controller
# CPU each, bench/scale/scale_placement.py): from 1,000 servers on the safety poll stretches
# (80 s at 8,000) so that it stays near 0.15 of a core, instead of growing with the servers.
SAFETY_READS_PER_S = 100.0
# A server the watch cannot connect to is tried again this often (a refused connect is cheap),
# so one that comes back is re-read within this long.
DOWN_RETRY_S = 1.0
# Kernel keep-alive on the watch's connections: a host that dies without closing its sockets
# (power, network) is noticed after about IDLE + INTERVAL * COUNT seconds of silence.
KEEPALIVE_IDLE_S = 2
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_COUNT = 2
# After a restore pass that could not restore everything (a load failed), the watch waits this
# long before the next try instead of hammering the servers.
RESTORE_RETRY_S = 1.0


class RedundancyWatch:
    """The watch loop of PlacementController (mixed into it; start() runs `_watch` in its own
    thread): restore passes on the events above, with the controller's server list, stop event,
    tick and safety poll."""

    notified: bool
    watch_s: float
    safety_poll_s: float
    timeout: float
    _stop: threading.Event
    _servers: Callable[[], Sequence[str]]
    restore: Callable[[], RebalanceReport | None]

    def _watch(self) -> None:
        if self.notified:
            self._watch_notified()
            return
        while not self._stop.wait(self.watch_s):
            try:
                report = self.restore()
            except Exception:  # a failed restore is logged; the next tick tries again
                log.exception("placement: restore pass failed")
                report = None
            if report is not None and report.errors:
                self._stop.wait(RESTORE_RETRY_S)

    def _watch_notified(self) -> None:
        """Restore passes on events only: the server list changed, a server's connection closed
        and it refuses a new one (lost), a lost one accepts again, or safety_poll_s passed."""
        conns = _ServerConnections(self.timeout)
        known: list[str] | None = None
        next_read = 0.0  # the first pass reads at once
        try:
            while not self._stop.is_set():
                try:
                    urls = list(self._servers())
                except Exception:  # the caller's list failed: keep the last one
                    log.exception("placement: the server list could not be read")
                    urls = known or []
                if urls != known:
                    known = urls
                    conns.track(urls)
                    next_read = 0.0
                if time.monotonic() >= next_read:
                    period = max(self.safety_poll_s, len(urls) / SAFETY_READS_PER_S)
                    next_read = time.monotonic() + period
                    try:
                        report = self.restore()
                    except Exception:  # a failed restore is logged; the next event tries again
                        log.exception("placement: restore pass failed")
                        report = None
                    if report is not None and report.errors:
                        next_read = time.monotonic() + RESTORE_RETRY_S
                if conns.wait(self.watch_s):
                    next_read = 0.0
        finally:
            conns.close()


class _ServerConnections:
    """One idle TCP connection to each server's control port, held by the notified watch. No
    request is ever sent on it: the kernel says when it closes (the server process died, or its
    HTTP server dropped the idle connection) or stops answering keep-alive probes (its host is
    gone). A closed one is reconnected at once; a refused reconnect means the server is lost."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._sel = selectors.DefaultSelector()
        self._socks: dict[str, socket.socket] = {}
        self._down: dict[str, float] = {}  # url -> when to try connecting again

    def track(self, urls: list[str]) -> None:
        for url in set(self._socks) - set(urls):
            self._drop(url)
        for url in set(self._down) - set(urls):
            del self._down[url]
        for url in urls:
            if url not in self._socks and url not in self._down:
                self._connect(url)

    def _connect(self, url: str) -> bool:
        try:
            u = httpx.URL(url)
            sock = socket.create_connection((u.host, u.port or 80), timeout=self.timeout)
        except (OSError, httpx.InvalidURL):
            self._down[url] = time.monotonic() + DOWN_RETRY_S
            return False
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ):
            if hasattr(socket, opt):  # Linux; elsewhere the system's keep-alive defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
        sock.setblocking(False)
        self._socks[url] = sock
        self._down.pop(url, None)
        self._sel.register(sock, selectors.EVENT_READ, url)
        return True

    def _drop(self, url: str) -> None:
        sock = self._socks.pop(url)
        self._sel.unregister(sock)
        sock.close()

    def wait(self, timeout: float) -> bool:
        """Waits up to `timeout` for an event; True when a server was lost or came back."""
        changed = False
        if self._socks:
            events = self._sel.select(timeout)
        else:
            time.sleep(timeout)
            events = []
        for key, _ in events:
            url = key.data
            try:
                if key.fileobj.recv(1):  # a server never writes here unasked: ignore it
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass  # reset, or keep-alive timed out: closed like an EOF
            self._drop(url)
            if not self._connect(url):
                changed = True
        now = time.monotonic()
        for url, at in list(self._down.items()):
            if now >= at and self._connect(url):
                changed = True
        return changed

    def close(self) -> None:
        for url in list(self._socks):
            self._drop(url)
        self._sel.close()
