"""The expert servers an attention client talks to: one connection (channel, session secret,
hosted experts) per server URL, the expert map of every layer over the live ones, and who is
out for now — evicted after a failure and readmitted only once its /health passes, left out at
connect because it did not answer, or dropped its session and reconnected."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from moecomm.errors import MoecommError, PeerLostError
from moecomm.ops.dispatch import ExpertMap
from moecomm.runtime.control import (
    ServerUnreachableError,
    http_connect,
    http_disconnect,
    http_health,
    http_placement,
    http_transports,
)
from moecomm.runtime.server_placement import EPOCH_OFFSET, EpochWord
from moecomm.wire.choose import TransportSet, choose
from moecomm.wire.client import ClientChannel
from moecomm.wire.protocol import SlotLayout

log = logging.getLogger("moecomm.client")

# An evicted server is routed to again only once its /health answers within this long.
HEALTH_PROBE_TIMEOUT_S = 2.0
# After a refresh that fetched a table, the epoch words are read again (a change that came
# before the fetched one is visible by then); a placement that keeps changing under the client
# is picked up over at most this many passes here, the rest at the next micro-batch.
REFRESH_ROUNDS = 4
# Local expert indices at and above this are placeholders for experts with no live replica.
_NO_LOCAL = 1 << 30


class _PolledEpoch:
    """A server's own epoch word, mapped: read with a transfer (over nixl, an 8-byte READ per
    micro-batch). Only for servers from before pushed epochs, which ignore `placement_word`."""

    def __init__(self, transport, region):
        self.transport = transport
        self.region = region

    def read(self) -> int:
        return self.transport.load(self.region, EPOCH_OFFSET)

    def close(self) -> None:
        self.region.close()


class ServerPool:
    def __init__(
        self,
        urls: list[str],
        client_id: int,
        layout: SlotLayout,
        num_slots: int,
        token: str,
        timeout: float,
        transports: TransportSet,
        evict_s: float,
    ):
        self.urls = list(urls)
        self.client_id = client_id
        self.layout = layout
        self.num_slots = num_slots
        self.token = token
        self.timeout = timeout
        self.transports = transports
        self.transport = transports.primary
        self.evict_s = evict_s
        self.channels: list[ClientChannel | None] = []
        self.sessions: list[str] = []  # per server: the secret of our connection
        self.hosted: list[dict[int, list[int]]] = []  # per server: local index -> expert or -1
        self.epochs: list[int] = []  # per server: the placement epoch `hosted` is from
        # Per server: where its placement epoch is read (None: a server with a fixed table) — our
        # own EpochWord the server pushes into, or, for an older server, its word (_PolledEpoch).
        self.epoch_words: list[EpochWord | _PolledEpoch | None] = []
        self.maps: dict[int, ExpertMap] = {}
        self.missing: dict[int, list[int]] = {}  # layer -> experts with no live replica
        self.evicted: dict[int, float] = {}  # server -> monotonic time it may come back
        self._probing: set[int] = set()  # evicted servers whose /health is being probed
        self._unattached: set[int] = set()  # servers unreachable at connect, not attached yet
        self._healthy: deque = deque()  # servers whose probe passed, appended by probe threads
        self.outstanding = [0] * len(self.urls)  # tokens in flight per server
        self.reconnects = 0

    def connect_all(self) -> None:
        """See AttentionClient.connect."""
        unreachable = []
        for i, url in enumerate(self.urls):
            try:
                self.attach(url)
            except ServerUnreachableError as exc:
                self.channels.append(None)
                self.sessions.append("")
                self.hosted.append({})
                self.epochs.append(0)
                self.epoch_words.append(None)
                self._unattached.add(i)
                self.evicted[i] = time.monotonic()  # probe at the first dispatch
                unreachable.append(f"{url}: {exc}")
        if len(unreachable) == len(self.urls):
            raise ServerUnreachableError("no expert server answered: " + "; ".join(unreachable))
        self.rebuild_maps()
        if self.missing:
            gone = f" (unreachable: {'; '.join(unreachable)})" if unreachable else ""
            raise MoecommError(f"experts without any server: {self.missing}{gone}")
        for why in unreachable:
            log.warning("client %d: left out for now, %s", self.client_id, why)

    def attach(self, url: str, index: int | None = None) -> None:
        # Per server: shm when it provably shares our /dev/shm, else nixl (wire/choose.py).
        name = choose(self.transports, http_transports(url, self.timeout), url)
        transport = self.transports.get(name)
        ch = ClientChannel(
            transport, self.layout, self.client_id, self.num_slots, name=f"server {url}"
        )
        # A word of our memory the server pushes every placement epoch change into: learning a
        # change then costs a local load, not a network read per micro-batch.
        pushed = EpochWord(transport)
        word = None
        try:
            info = http_connect(
                url,
                self.client_id,
                ch.handle,
                self.layout,
                self.num_slots,
                self.token,
                self.timeout,
                transport=name,
                session=self.sessions[index] if index is not None else "",
                extra={"placement_word": pushed.handle},
            )
            ch.connect(info["server_handle"], info["doorbell_handle"])
            if info.get("placement_pushed"):
                word, pushed = pushed, None
            elif info.get("placement_handle"):
                # A server from before pushed epochs ignores `placement_word`: read its own word
                # (one READ per micro-batch over nixl), as clients did then.
                word = _PolledEpoch(transport, transport.attach(info["placement_handle"]))
            # else: a server from before live re-placement; its table is fixed.
        except Exception:
            ch.close()
            if word is not None:
                word.close()
            raise
        finally:
            if pushed is not None:  # not subscribed: nobody writes it
                pushed.close()
        hosted = {int(k): v for k, v in info["hosted"].items()}
        epoch = int(info.get("placement_epoch", 0))
        if index is None:
            self.channels.append(ch)
            self.sessions.append(info.get("session", ""))
            self.hosted.append(hosted)
            self.epochs.append(epoch)
            self.epoch_words.append(word)
        else:  # reconnecting, or a server that left and came back under the same URL
            old = self.channels[index]
            self.channels[index] = ch
            self.sessions[index] = info.get("session", "")
            self.hosted[index] = hosted
            self.epochs[index] = epoch
            old_word, self.epoch_words[index] = self.epoch_words[index], word
            if old_word is not None:
                old_word.close()
            self._unattached.discard(index)
            if old is not None:
                old.close()

    def add(self, url: str) -> int:
        """Connects to a new server (or re-admits a known URL); returns its index."""
        if url in self.urls:
            i = self.urls.index(url)
            self.evicted.pop(i, None)
            if self.channels[i] is None:
                self.attach(url, i)
            self.rebuild_maps()
            return i
        self.urls.append(url)
        self.outstanding.append(0)
        try:
            self.attach(url)
        except Exception:
            self.urls.pop()
            self.outstanding.pop()
            raise
        self.rebuild_maps()
        return len(self.urls) - 1

    def remove(self, url: str) -> None:
        i = self.urls.index(url)
        ch = self.channels[i]
        self.channels[i] = None
        word, self.epoch_words[i] = self.epoch_words[i], None
        self.rebuild_maps()
        if ch is not None:
            ch.close()
        if word is not None:
            word.close()

    def live(self, server: int) -> bool:
        return server not in self.evicted and self.channels[server] is not None

    def readmit(self) -> None:
        """Evicted servers come back only healthy: once the eviction time passes their /health
        (a real forward pass) is probed in the background, and they rejoin when it answers."""
        changed = False
        while self._healthy:
            i = self._healthy.popleft()
            self._probing.discard(i)
            if i in self._unattached and not self._attach_late(i):
                continue
            if i in self.evicted and self.channels[i] is not None:
                del self.evicted[i]
                changed = True
        now = time.monotonic()
        for i, until in list(self.evicted.items()):
            known = self.channels[i] is not None or i in self._unattached
            if now >= until and i not in self._probing and known:
                self._probing.add(i)
                threading.Thread(
                    target=self._probe, args=(i, self.urls[i]), daemon=True, name="moecomm-probe"
                ).start()
        if changed:
            self.rebuild_maps()

    def _attach_late(self, i: int) -> bool:
        """Connects to a server that was unreachable at connect(), now that it answers."""
        try:
            self.attach(self.urls[i], i)
        except (ConnectionError, MoecommError) as exc:
            self.evicted[i] = time.monotonic() + self.evict_s
            log.warning(
                "client %d: %s still cannot be connected: %s", self.client_id, self.urls[i], exc
            )
            return False
        log.info("client %d: connected to %s", self.client_id, self.urls[i])
        return True

    def _probe(self, i: int, url: str) -> None:
        if http_health(url, HEALTH_PROBE_TIMEOUT_S):
            self._healthy.append(i)
        else:  # still unhealthy: wait another eviction period
            self.evicted[i] = time.monotonic() + self.evict_s
            self._probing.discard(i)

    def _reconnect(self, i: int, why: Exception) -> bool:
        """The server dropped our session (it marked our slots OFFLINE while alive: restarted
        under the same URL, or it took us for lost). Connect again at once; True on success."""
        try:
            self.attach(self.urls[i], i)
        except Exception as exc:  # still unreachable: it stays evicted
            log.warning(
                "client %d: session with %s lost (%s); reconnect failed: %s",
                self.client_id,
                self.urls[i],
                why,
                exc,
            )
            return False
        self.reconnects += 1
        log.warning(
            "client %d: session with %s lost (%s); reconnected", self.client_id, self.urls[i], why
        )
        return True

    def refresh_placement(self) -> None:
        """Between two micro-batches: a server whose placement epoch moved on since our table is
        asked for its new table (which acks it), and the expert maps are rebuilt once. The epoch
        is a word of our own memory the server pushed it into (a local load, no transfer); only
        an older server's word is read across (one READ per micro-batch over nixl). A server that
        does not answer keeps its old table (if it is gone, failover takes it out).

        A pushed word finds no dead server, as the READ did before any request went out: a dead
        server is found by the request itself (a send to it raises PeerLostError, or its answer
        misses the deadline), and combine() re-sends that share to a replica at once; the
        membership's loss events and the /health probes of readmit() work as before. A push that
        is late (or lost with its sender) only delays the new table: a request naming an expert
        the server no longer has gets STALE_MAP and is re-sent on a fresh table."""
        changed = False
        # A move publishes the new copy on one server before it marks the old one leaving on
        # another, but the words are read one after the other: a pass that read the first
        # server's word just before its load and the second's just after its leave would see
        # the expert leave without its new copy. So after fetching any table, the words are read
        # again: every push that came before the change we fetched is visible by then.
        for _ in range(REFRESH_ROUNDS):
            fetched = self._refresh_once()
            changed |= fetched
            if not fetched:
                break
        if changed:
            self.rebuild_maps()

    def _refresh_once(self) -> bool:
        """One pass over the epoch words; True when some table was fetched."""
        changed = False
        for i, word in enumerate(self.epoch_words):
            if word is None or not self.live(i):
                continue
            try:
                epoch = word.read()
            except (PeerLostError, TimeoutError) as exc:  # only a polled (remote) word
                self.evict(i, f"its placement word cannot be read: {exc}")  # rebuilds the maps
                continue
            # A pushed word holds 0 until the first push lands, and epochs only grow: a push
            # older than the table we fetched (it raced our GET) is no news.
            news = (
                epoch > self.epochs[i] if isinstance(word, EpochWord) else epoch != self.epochs[i]
            )
            if news:
                changed |= self.fetch_placement(i)
        return changed

    def fetch_placement(self, i: int) -> bool:
        """Reads server `i`'s table (acking its epoch); True when it answered."""
        try:
            info = http_placement(self.urls[i], self.client_id, self.timeout)
        except ConnectionError as exc:
            log.warning("client %d: placement of %s: %s", self.client_id, self.urls[i], exc)
            return False
        self.hosted[i] = {int(k): v for k, v in info["layers"].items()}
        self.epochs[i] = int(info["epoch"])
        return True

    def rebuild_maps(self) -> None:
        layers = sorted({layer for h in self.hosted for layer in h})
        maps, missing = {}, {}
        for layer in layers:
            replicas: dict[int, list[tuple[int, int]]] = {}
            num_experts = 0
            for server, h in enumerate(self.hosted):
                ids = h.get(layer, [])
                num_experts = max([num_experts, *(e + 1 for e in ids)])
                if not self.live(server):
                    continue
                for local, expert in enumerate(ids):
                    if expert >= 0:  # -1: an index retired or leaving, never routed to
                        replicas.setdefault(expert, []).append((server, local))
            lost = [e for e in range(num_experts) if e not in replicas]
            if lost:
                missing[layer] = lost
            # Experts with no live replica keep a placeholder entry (a local index no server
            # has) that is never routed to: dispatch refuses such experts by name first.
            table = [replicas.get(e, [(0, _NO_LOCAL + e)]) for e in range(num_experts)]
            maps[layer] = ExpertMap(table, num_servers=len(self.urls))
        self.maps, self.missing = maps, missing

    def evict(self, server: int, reason: str = "") -> None:
        """Takes `server` out of every expert map for `evict_s` seconds, and then until its
        /health passes."""
        self.evicted[server] = time.monotonic() + self.evict_s
        self.rebuild_maps()

    def recover_session(self, i: int, exc: Exception) -> None:
        """A live server that dropped our session gets a new one at once. A server accepts a
        connect only while its loop is healthy, so a successful one also ends the eviction."""
        if self._reconnect(i, exc):
            self.evicted.pop(i, None)
            self.rebuild_maps()

    def close(self) -> None:
        for url, ch, session in zip(self.urls, self.channels, self.sessions, strict=False):
            if ch is not None:
                # The client's own deadline: a stopped server must not hold close() for long.
                http_disconnect(
                    url, self.client_id, self.token, timeout=self.timeout, session=session
                )
                ch.close()
        for word in self.epoch_words:
            if word is not None:
                word.close()
        self.channels = []
        self.sessions = []
        self.epochs = []
        self.epoch_words = []
