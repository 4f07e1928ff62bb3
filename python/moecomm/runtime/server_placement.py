"""The expert server's table of hosted experts as it changes while serving.

A placement change never renumbers: a new expert gets a new local index, a dropped one leaves a
retired index behind (LayerExperts). Every change bumps the server's placement epoch and is pushed
(subscribe) into a word of each connected client's own memory (one signal per change and
client: over nixl a notification, no network read per dispatch); the client loads its own word
at each dispatch and, on a change, fetches the table (GET /experts?client_id=...), which tells
the server it has it (an ack). A client of an older server, which does not push, reads the
server's epoch word instead (a one-line region every client maps at connect). Either way, the
stale-map rule below stays the safety net: a push that is late only delays the new table.

Dropping an expert has two steps. Unload marks it *leaving*: it disappears from the published
table, so clients stop routing to it, but it is still served. It is freed only once every
connected client has acked the epoch that announced it and the loop has polled every slot
since (requests written before the ack are then answered), or, for clients that stay idle,
after DROP_GRACE_S. A client that still names the retired index gets STALE_MAP and re-sends on
a fresh table: late, never lost, never computed by the wrong expert.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from moecomm import _C
from moecomm.errors import DeadlineExceededError, MoecommError, PeerLostError
from moecomm.runtime.experts import ExpertWeights, LayerExperts
from moecomm.runtime.registry import ClientRegistry
from moecomm.wire.transport import Region, SignalOp, Transport

log = logging.getLogger("moecomm.server")

# A leaving expert is freed this long after it was unloaded even if some connected client never
# picked up the new table (it is idle: it routes nothing). A late request gets STALE_MAP.
DROP_GRACE_S = 2.0
# How often a pending drop re-checks its clients' acks.
DROP_POLL_S = 0.02
# The epoch region is one signal line; the word sits at its start.
EPOCH_REGION_BYTES = _C.DOORBELL_BYTES
EPOCH_OFFSET = 0


class ExpertHostedError(MoecommError, ValueError):
    """The server already hosts (and publishes) this expert."""


class ServerPlacement:
    def __init__(
        self,
        layers: dict[int, LayerExperts],
        hidden: int,
        transport: Transport,
        clients: ClientRegistry,
        on_change: Callable[[], None] = lambda: None,
    ):
        self.layers = layers  # the server's dict: swapped entries, never mutated objects
        self.hidden = hidden
        self.transport = transport
        # The epoch word: a signal line of its own (word operations are line-aligned).
        self.region: Region = transport.create_region(EPOCH_REGION_BYTES)
        # The same word in the memory of every other transport the server offers (a client
        # maps the one of the transport it speaks).
        self.mirrors: dict[str, tuple[Transport, Region]] = {}
        self.clients = clients
        self.on_change = on_change
        # Held by the serving loop while it checks and serves a batch: a table swap happens
        # between two batches, never under one.
        self.lock = threading.Lock()
        # One placement change at a time (loads can be slow; they build outside `lock`).
        self._mutate = threading.Lock()
        self.epoch = 1
        # Rebuilds of a layer's stacked weights by placement changes (a batch of loads or of
        # drops rebuilds each layer it touches once): published with the table.
        self.layer_builds = 0
        self.leaving: dict[tuple[int, int], int] = {}  # (layer, expert) -> epoch it left at
        self.retired_layers: set[int] = set()
        self._acks: dict[int, tuple[int, float]] = {}  # client -> (epoch, when)
        # client -> (transport, the client's epoch word): pushed to on every change. The lock
        # orders a subscription's first write against the pushes of concurrent changes.
        self._pushed: dict[int, tuple[Transport, Region]] = {}
        self._push_lock = threading.Lock()
        # Poll start of the last loop pass that served everything it found.
        self.served_through = 0.0
        self._stop = threading.Event()
        self._publish_epoch()

    # ------------------------------------------------------------------ reading
    def published(self) -> dict[int, list[int]]:
        """{layer: logical expert per local index}, -1 where retired or leaving."""
        return {
            layer: [-1 if e < 0 or (layer, e) in self.leaving else e for e in le.slots]
            for layer, le in sorted(self.layers.items())
        }

    def hosted_ids(self) -> dict[int, list[int]]:
        """{layer: the experts clients may route here}, for membership records."""
        return {layer: sorted(e for e in ids if e >= 0) for layer, ids in self.published().items()}

    def describe(self, client_id: int | None = None) -> dict:
        """The table and its epoch, read together; a client reading it acks that epoch."""
        with self.lock:
            out = {
                "epoch": self.epoch,
                "layers": self.published(),
                "leaving": self._leaving(),
                "layer_builds": self.layer_builds,
            }
        if client_id is not None:
            self.ack(client_id, out["epoch"])
        return out

    def _leaving(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for layer, e in sorted(self.leaving):
            out.setdefault(layer, []).append(e)
        return out

    def ack(self, client_id: int, epoch: int) -> None:
        if client_id not in self.clients.ids():
            return  # only connected clients are waited for (and the table stays bounded)
        prev = self._acks.get(client_id)
        if prev is None or prev[0] < epoch:
            self._acks[client_id] = (epoch, time.monotonic())

    def is_stale(self, layer_id: int, ids) -> bool:
        """True when a request names a retired index (or a layer no longer hosted): its client's
        table is older than ours."""
        layer = self.layers.get(layer_id)
        if layer is None:
            return layer_id in self.retired_layers
        if layer.contiguous:
            return False
        # Indices past the table are not stale (indices only grow): the bounds check names them.
        used = ids[(ids >= 0) & (ids < layer.num_local)].long()
        return bool((layer.rows[used] < 0).any()) if used.numel() else False

    # ------------------------------------------------------------------ changing
    def add_transport(self, transport: Transport) -> None:
        """Publishes the epoch word in `transport`'s memory as well."""
        if transport.name == self.transport.name or transport.name in self.mirrors:
            return
        region = transport.create_region(EPOCH_REGION_BYTES)
        transport.signal(region, EPOCH_OFFSET, self.epoch, SignalOp.SET)
        self.mirrors[transport.name] = (transport, region)

    def handle(self, transport_name: str) -> str:
        """The handle of the epoch word a client of `transport_name` maps."""
        if transport_name in self.mirrors:
            return self.mirrors[transport_name][1].handle
        return self.region.handle

    def _publish_epoch(self) -> None:
        self.transport.signal(self.region, EPOCH_OFFSET, self.epoch, SignalOp.SET)
        for t, region in self.mirrors.values():
            t.signal(region, EPOCH_OFFSET, self.epoch, SignalOp.SET)
        with self._push_lock:
            epoch = self.epoch  # read under the lock: a newer change pushes its own after us
            for client_id, (t, word) in list(self._pushed.items()):
                self._push(client_id, t, word, epoch)

    def _push(self, client_id: int, transport: Transport, word: Region, epoch: int) -> None:
        """One signal into a client's epoch word (the push lock is held). A client that cannot
        be reached is unsubscribed: its liveness is the registry's business, and a client that
        comes back subscribes again at connect."""
        try:
            transport.signal(word, EPOCH_OFFSET, epoch, SignalOp.SET)
        except (PeerLostError, DeadlineExceededError) as exc:
            log.warning("placement: epoch %d not pushed to client %d: %s", epoch, client_id, exc)
            self._pushed.pop(client_id, None)
            word.close()

    def subscribe(self, client_id: int, transport: Transport, handle: str) -> None:
        """From now on every epoch change is written into the client's word at `handle` (offset
        EPOCH_OFFSET of a region of the client's, reached over `transport`), starting with the
        current epoch at once. A client has one word: subscribing again replaces it."""
        word = transport.attach(handle)
        if word.size < EPOCH_OFFSET + 8:
            word.close()
            raise ValueError(f"a placement epoch word needs 8 bytes at offset {EPOCH_OFFSET}")
        with self._push_lock:
            old = self._pushed.pop(client_id, None)
            self._pushed[client_id] = (transport, word)
            self._push(client_id, transport, word, self.epoch)
        if old is not None:
            old[1].close()

    def unsubscribe(self, client_id: int) -> None:
        """No more pushes to this client (it left)."""
        with self._push_lock:
            old = self._pushed.pop(client_id, None)
        if old is not None:
            old[1].close()

    def subscribers(self) -> list[int]:
        with self._push_lock:
            return sorted(self._pushed)

    def _swap(self, new: dict[int, LayerExperts | None]) -> None:
        """Under `lock`: installs the layers' new tables (None: a layer no longer hosted) and
        announces them in one epoch."""
        for layer_id, table in new.items():
            if table is None:
                self.layers.pop(layer_id, None)
                self.retired_layers.add(layer_id)
            else:
                self.layers[layer_id] = table
                self.retired_layers.discard(layer_id)
        self.epoch += 1
        self._publish_epoch()

    def add(self, layer_id: int, expert: int, w: ExpertWeights) -> dict:
        """Hosts `expert` of `layer_id` from now on (a new local index). An expert that is
        leaving is simply kept; one already published raises ExpertHostedError."""
        return self.add_many([(layer_id, expert, w)])

    def _fit(self, layer_id: int, w: ExpertWeights) -> ExpertWeights:
        """`w` in the dtype of the layer it joins (checked against its shape)."""
        current = self.layers.get(layer_id)
        if current is None:
            return w
        if w.w1.dtype != current.dtype:
            w = ExpertWeights(*(t.to(current.dtype) for t in (w.w1, w.w3, w.w2)))
        if w.intermediate != current.intermediate:
            raise ValueError(
                f"expert intermediate {w.intermediate} does not match layer "
                f"{layer_id}'s {current.intermediate}"
            )
        return w

    def add_many(self, items) -> dict:
        """Hosts every (layer, expert, weights) of `items` from now on, all at once: each layer
        is rebuilt once for all its new experts, and the new table is published in one epoch,
        after every weight is in place (a client never sees a route to an expert that is not
        loaded yet). Experts that are leaving are simply kept. All or nothing: a bad item (an
        expert already published, a duplicate, a shape that does not fit) refuses the batch
        before anything changes."""
        items = [(int(la), int(e), w) for la, e, w in items]
        if not items:
            raise ValueError("no expert to load")
        seen: set[tuple[int, int]] = set()
        for layer_id, expert, w in items:
            if expert < 0:
                raise ValueError(f"expert ids are >= 0, got {expert}")
            if (layer_id, expert) in seen:
                raise ValueError(f"layer {layer_id} expert {expert} is named twice")
            seen.add((layer_id, expert))
            if w.hidden != self.hidden:
                raise ValueError(
                    f"expert hidden {w.hidden} does not match this server's {self.hidden}"
                )
        with self._mutate:
            kept, added = [], {}
            for layer_id, expert, w in items:
                current = self.layers.get(layer_id)
                if current is not None and current.local_of(expert) is not None:
                    if (layer_id, expert) not in self.leaving:
                        raise ExpertHostedError(
                            f"layer {layer_id} expert {expert} is already hosted"
                        )
                    kept.append((layer_id, expert))
                    continue
                added.setdefault(layer_id, {})[expert] = self._fit(layer_id, w)
            new = {}
            for layer_id, experts in added.items():  # built outside `lock`: serving goes on
                current = self.layers.get(layer_id)
                first = {e: experts[e] for e in sorted(experts)} if current is None else experts
                new[layer_id] = (
                    LayerExperts(layer_id, first)
                    if current is None
                    else current.with_experts(first)
                )
                self.layer_builds += 1
            with self.lock:
                for key in kept:
                    del self.leaving[key]
                self._swap(new)
            epoch = self.epoch
        self.on_change()
        return {"epoch": epoch, "kept": len(kept), "added": sum(len(x) for x in added.values())}

    def unload(self, layer_id: int, expert: int) -> dict:
        """Marks `expert` leaving; it is freed once no client can route to it any more."""
        return self.unload_many([(layer_id, expert)])

    def unload_many(self, items) -> dict:
        """Marks every (layer, expert) of `items` leaving, in one epoch; they are freed together
        (one rebuild per layer) once no client can route to them any more. Experts already
        leaving stay as they are; one not hosted here refuses the batch (KeyError)."""
        items = sorted({(int(la), int(e)) for la, e in items})
        if not items:
            raise ValueError("no expert to unload")
        with self._mutate:
            for layer_id, expert in items:
                current = self.layers.get(layer_id)
                if current is None or current.local_of(expert) is None:
                    raise KeyError(f"layer {layer_id} expert {expert} is not hosted here")
            marked = [key for key in items if key not in self.leaving]
            if not marked:
                return {"epoch": self.epoch, "leaving": True, "marked": 0}
            with self.lock:
                self.epoch += 1
                for key in marked:
                    self.leaving[key] = self.epoch
                self._publish_epoch()
            epoch = self.epoch
        self.on_change()
        threading.Thread(
            target=self._drop_when_released,
            args=(marked, epoch, time.monotonic()),
            name="moecomm-drop",
            daemon=True,
        ).start()
        return {"epoch": epoch, "leaving": True, "marked": len(marked)}

    def _all_acked_at(self, epoch: int, since: float) -> float | None:
        """When the last connected client acked `epoch` (None: some have not)."""
        latest = since
        for cid in self.clients.ids():
            got = self._acks.get(cid)
            if got is None or got[0] < epoch:
                return None
            latest = max(latest, got[1])
        return latest

    def _drop_when_released(self, items: list[tuple[int, int]], epoch: int, marked: float) -> None:
        while not self._stop.is_set():
            acked = self._all_acked_at(epoch, marked)
            if acked is None and time.monotonic() >= marked + DROP_GRACE_S:
                acked = marked + DROP_GRACE_S
            if acked is not None and self.served_through > acked:
                break
            self._stop.wait(DROP_POLL_S)
        else:
            return
        with self._mutate:
            # Loaded again meanwhile: it stays.
            gone = [key for key in items if self.leaving.get(key) == epoch]
            if not gone:
                return
            by_layer: dict[int, list[int]] = {}
            for layer_id, expert in gone:
                by_layer.setdefault(layer_id, []).append(expert)
            new = {}
            for layer_id, experts in by_layer.items():
                new[layer_id] = self.layers[layer_id].without_experts(experts)
                self.layer_builds += 1
            with self.lock:
                for key in gone:
                    del self.leaving[key]
                self._swap(new)
        log.info("dropped %s (epoch %d)", gone, self.epoch)
        self.on_change()

    def forget(self, client_id: int) -> None:
        """A client left (disconnected, or dropped as dead): its ack is no longer kept, and its
        epoch word no longer pushed to."""
        self._acks.pop(client_id, None)
        self.unsubscribe(client_id)

    def close(self) -> None:
        self._stop.set()
        with self._push_lock:
            pushed, self._pushed = list(self._pushed.values()), {}
        for _, word in pushed:
            word.close()
        self.region.close()
        for _, region in self.mirrors.values():
            region.close()


class EpochWord:
    """A client's end of a pushed placement epoch: a word in the client's own memory that the
    server writes on every change (ServerPlacement.subscribe with `handle`). Reading it is a
    load of local memory, never a transfer; 0 until the server's first push."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.region: Region = transport.create_region(EPOCH_REGION_BYTES)

    @property
    def handle(self) -> str:
        return self.region.handle

    def read(self) -> int:
        return self.transport.load(self.region, EPOCH_OFFSET)

    def close(self) -> None:
        self.region.close()
