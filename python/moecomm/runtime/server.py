"""The expert server: hosts experts of any layers, answers clients over the slot protocol.

A loop with no client coupling (docs/design.md, "Expert server"): poll every client's request slots,
take every ready one (optionally waiting a batching window for more), reorganize the tokens of
all ready batches of a layer together, run the grouped expert MLP over the active experts only,
write each client's response and signal it with the request's sequence number. An idle server
sleeps on one shared doorbell; every wait has a deadline. A malformed request gets an error
response and the loop goes on serving everyone else.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch

from moecomm import _C
from moecomm.errors import MoecommError
from moecomm.runtime.experts import ExpertWeights, LayerExperts
from moecomm.runtime.health import LoopHealth, ServerStats
from moecomm.runtime.registry import ClientRegistry
from moecomm.runtime.server_placement import ServerPlacement
from moecomm.runtime.server_step import StepBuffers, answer_layer
from moecomm.runtime.weights import WeightExports
from moecomm.wire.choose import Doorbells, ShmProbe, TransportSet, boot_id
from moecomm.wire.protocol import ResponseStatus, SlotLayout
from moecomm.wire.server import Request, ServerChannel
from moecomm.wire.transport import Transport

log = logging.getLogger("moecomm.server")

# An idle server wakes this often to check that its clients are still alive.
IDLE_WAKE_S = 0.1
# A busy server checks its clients' liveness this often too: under continuous load the idle
# wake never comes, and a dead client's slots would be held for ever.
CLIENT_CHECK_S = 0.5
# A write to a client over nixl waits for the client's side of the transfer: a stopped client
# stalls the loop at most this long per answer (then the answer fails and the loop goes on).
SERVER_XFER_TIMEOUT_S = 0.5
# Limits on what a client may ask for at connect time: they bound the memory one connect costs.
MAX_SLOTS_PER_CLIENT = 16
MAX_REGION_BYTES = 1 << 30

ChannelFactory = Callable[..., ServerChannel]
# (layer, expert) -> that expert's weights: where a server loads experts it is asked to host
# (a checkpoint reader, or a seeded generator in tests and benchmarks).
WeightSource = Callable[[int, int], ExpertWeights]

__all__ = ["ExpertServer", "ServerStats"]


class ExpertServer:
    """Hosts `experts` = {layer: {logical expert: ExpertWeights}} (any subset of any layers).

    `channel_factory(transport, layout, client_id, num_slots, name=...)` builds the server end of
    each client connection (a ServerChannel by default; benchmarks wrap it, e.g. to emulate a
    network link). `weight_source(layer, expert)` reads an expert's weights when the server is
    asked to host one it does not have (live re-placement; see ServerPlacement).

    `transport`: a Transport, or "shm", "nixl" or "auto" (both: each client speaks the one it
    negotiated, see wire/choose.py); `host` is the address the server is reached at
    (nixl carries bytes over that interface)."""

    def __init__(
        self,
        experts: Mapping[int, Mapping[int, ExpertWeights]],
        server_id: str = "expert-server",
        transport: Transport | str | None = None,
        batching_window_s: float = 0.0,
        channel_factory: ChannelFactory = ServerChannel,
        weight_source: WeightSource | None = None,
        host: str | None = None,
    ):
        if not experts:
            raise ValueError("an expert server needs at least one hosted layer")
        if batching_window_s < 0:
            raise ValueError(f"batching_window_s must be >= 0, got {batching_window_s}")
        self.server_id = server_id
        self.layers = {int(k): LayerExperts(k, e) for k, e in experts.items()}
        hidden = {le.hidden for le in self.layers.values()}
        if len(hidden) != 1:
            raise ValueError(f"hosted layers disagree on the hidden size: {sorted(hidden)}")
        self.hidden = hidden.pop()
        self.buffers = StepBuffers(self.layers)
        self.transports = TransportSet(transport, host, SERVER_XFER_TIMEOUT_S)
        self.transport = self.transports.primary
        self.batching_window_s = batching_window_s
        self._channel_factory = channel_factory
        self.doorbells = Doorbells(self.transports)
        has_shm = "shm" in self.transports.names
        self.shm_probe = ShmProbe(self.transports.get("shm")) if has_shm else None
        self.stats = ServerStats()
        self.health = LoopHealth()
        self.clients = ClientRegistry(server_id)
        self._next_client_check = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.draining = False
        self._registration = None  # membership registration (see join_membership)
        # The NVSHMEM job this server created, if any (runtime/nvshmem_job.py, GPU servers).
        self.nvshmem_job = None
        self._watcher = None
        self.weight_source = weight_source
        self.exports = WeightExports(self.transport)
        self.placement = ServerPlacement(
            self.layers,
            self.hidden,
            self.transport,
            self.clients,
            on_change=self._publish_membership,
        )
        for name in self.transports.names:
            self.placement.add_transport(self.transports.get(name))

    # ------------------------------------------------------------------ membership of clients
    def hosted(self) -> dict[int, list[int]]:
        """{layer: logical expert of each local index}, -1 for an index clients must not use."""
        return self.placement.published()

    def served_transports(self) -> list[str]:
        """The transports clients may connect over (GET /transports, membership metadata)."""
        return list(self.transports.names)

    def offer(self) -> dict:
        """What a client needs to pick a transport (GET /transports): the ones served here,
        this host's boot id and the shm probe word."""
        return {
            "transports": self.served_transports(),
            "boot_id": boot_id(),
            "shm_probe": self.shm_probe.describe() if self.shm_probe is not None else None,
        }

    def connect(
        self,
        client_id: int,
        client_handle: str,
        layout: SlotLayout,
        num_slots: int,
        session: str = "",
        transport: str | None = None,
        response_ring_offset: int = 0,
        placement_word: str = "",
    ) -> dict:
        """Allocates request slots for a client and attaches to its response slots. The answer
        carries a session secret: a later connect under the same id (the client reconnecting)
        must present it, unless the process that held the id died. Raises ClientIdInUseError when
        another live client holds `client_id`.

        `placement_word`: the handle of a word in the client's memory (an EpochWord) into which
        every placement epoch change is pushed from now on (ServerPlacement.subscribe), so the
        client never reads ours across the network; the answer's `placement_pushed` says so. A
        handle that cannot be attached is refused (ValueError) and the client is not admitted."""
        if self.draining:
            raise MoecommError(f"{self.server_id} is draining and accepts no new clients")
        if not self.health.ok:
            raise MoecommError(f"{self.server_id} is unhealthy: {self.health.reason}")
        if layout.hidden != self.hidden:
            raise ValueError(f"hidden {layout.hidden} does not match this server's {self.hidden}")
        if response_ring_offset:
            raise ValueError("response_ring_offset is for cuda_ipc clients of a GPU server")
        name = transport or self.transport.name
        if name not in self.transports.names:
            raise MoecommError(
                f"{self.server_id} serves over {', '.join(self.transports.names)}, not {name!r}"
            )
        if not 1 <= num_slots <= MAX_SLOTS_PER_CLIENT:
            raise ValueError(f"num_slots must be in [1, {MAX_SLOTS_PER_CLIENT}], got {num_slots}")
        need = _C.SlotRing(layout.config, num_slots, True).region_bytes
        if need > MAX_REGION_BYTES:
            raise ValueError(
                f"the slot layout needs {need} bytes per client, over the "
                f"{MAX_REGION_BYTES}-byte limit"
            )

        def make_channel() -> ServerChannel:
            channel = self._channel_factory(
                self.transports.get(name), layout, client_id, num_slots, name=f"client {client_id}"
            )
            try:
                channel.connect(client_handle)
            except Exception:
                channel.close()
                raise
            return channel

        new = self.clients.admit(client_id, session, make_channel)
        if placement_word:
            # After admit: a connect refused there (the id is someone else's) must not replace
            # that client's subscription. Refused here, the half-made connection is undone.
            try:
                self.placement.subscribe(client_id, self.transports.get(name), placement_word)
            except (ValueError, OSError, MoecommError) as exc:
                self.clients.remove(client_id, new.secret)
                self.placement.forget(client_id)
                raise ValueError(
                    f"placement_word {placement_word[:64]!r} cannot be used: {exc}"
                ) from exc
        self.buffers.reserve(layout, num_slots)
        channel = new.channel
        table = self.placement.describe(client_id)
        return {
            "server_id": self.server_id,
            "server_handle": channel.handle,
            "transport": name,
            "doorbell_handle": self.doorbells.handle(name),
            "num_slots": num_slots,
            "request_slot_bytes": layout.request_slot_bytes,
            "slot_offsets": [channel.request_ring.slot_offset(s) for s in range(num_slots)],
            "hosted": table["layers"],
            "placement_epoch": table["epoch"],
            "placement_handle": self.placement.handle(name),
            "placement_pushed": bool(placement_word),
            "session": new.secret,
        }

    def disconnect(self, client_id: int, session: str | None = None) -> bool:
        """Frees a client's slots; with `session`, only the connection it names."""
        removed = self.clients.remove(client_id, session)
        if removed:
            self.placement.forget(client_id)
        return removed

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    # ------------------------------------------------------------------ the loop
    def step(self, timeout: float = IDLE_WAKE_S) -> int:
        """One pass of the loop: serves every ready request, or sleeps up to `timeout` for one.
        Returns how many requests were answered (errors included)."""
        if time.monotonic() >= self._next_client_check:
            self._drop_dead_clients()
        seen = self.doorbells.values()
        # Every request signalled before `polled` is answered by the end of this pass: a
        # pending expert drop waits for a pass that started after its clients' acks.
        polled = time.monotonic()
        ready = self._poll()
        if not ready:
            if not self.doorbells.wait(seen, timeout):
                self.placement.served_through = polled
                return 0
            polled = time.monotonic()
            ready = self._poll()
        if ready and self.batching_window_s > 0:
            time.sleep(self.batching_window_s)
            polled = time.monotonic()
            ready = self._poll()
        with self.placement.lock:  # a placement change waits for the batch
            n = self._serve(ready)
        self.placement.served_through = polled
        return n

    def _poll(self) -> list[tuple[ServerChannel, Request]]:
        return [(ch, req) for ch in self.clients.channels() for req in ch.poll()]

    def _drop_dead_clients(self) -> None:
        self._next_client_check = time.monotonic() + CLIENT_CHECK_S
        dropped = self.clients.drop_dead()
        for client_id in dropped:
            self.placement.forget(client_id)
        self.stats.dead_clients_dropped += len(dropped)
        if dropped:
            log.info("%s: dropped dead clients %s", self.server_id, dropped)

    def _reject(self, ch: ServerChannel, req: Request, status: int, reason: str) -> None:
        try:
            ch.reject(req, status, reason)
        except Exception:  # the client's memory is gone or broken: it is dropped as dead later
            log.exception("%s: cannot answer client %d", self.server_id, ch.client_id)
        self.stats.count_rejection(status)

    def _serve(self, ready: list[tuple[ServerChannel, Request]]) -> int:
        start = time.perf_counter()
        by_layer: dict[int, list[tuple[ServerChannel, Request]]] = defaultdict(list)
        for ch, req in ready:
            problem = self._check(req)
            if problem is not None:
                self._reject(ch, req, *problem)
            else:
                by_layer[req.layer_id].append((ch, req))
        for layer_id, items in by_layer.items():
            try:
                self._run_layer(layer_id, items)
            except Exception as exc:  # answers every request of the batch not yet answered
                self.stats.batch_failures += 1
                log.exception("%s: batch of layer %d failed", self.server_id, layer_id)
                reason = f"{self.server_id} layer {layer_id}: {type(exc).__name__}: {exc}"
                for ch, req in items:
                    if req.activations is not None:  # not released yet
                        self._reject(ch, req, int(ResponseStatus.SERVER_ERROR), reason)
        self.stats.busy_s += time.perf_counter() - start
        return len(ready)

    def _check(self, req: Request):
        """Validates a request on the server's own copies of its fields."""
        if not req.valid:
            return int(req.code), _C.validate_reason(req.code)
        if self.draining:
            return int(ResponseStatus.DRAINING), f"{self.server_id} is draining"
        if self.placement.is_stale(req.layer_id, req.expert_ids):
            return (
                int(ResponseStatus.STALE_MAP),
                f"{self.server_id} layer {req.layer_id}: the request names an expert this "
                f"server no longer hosts (its placement is at epoch {self.placement.epoch})",
            )
        layer = self.layers.get(req.layer_id)
        if layer is None:
            return (
                int(ResponseStatus.UNKNOWN_LAYER),
                f"{self.server_id} hosts no expert of layer {req.layer_id}",
            )
        ids = req.expert_ids
        bad = (ids < -1) | (ids >= layer.num_local)
        if bool(bad.any()):
            e = int(ids[bad][0])
            return (
                int(ResponseStatus.UNKNOWN_EXPERT),
                f"{self.server_id} layer {req.layer_id}: local expert {e} is not in "
                f"[0, {layer.num_local})",
            )
        return None

    def _run_layer(self, layer_id: int, items) -> None:
        layer = self.layers[layer_id]
        counts = torch.zeros(layer.num_local, dtype=torch.int64)
        for _, req in items:  # the server's own copies of the ids: never the slot
            valid = req.expert_ids[req.expert_ids >= 0].to(torch.int64)
            counts += torch.bincount(valid, minlength=layer.num_local)
        self.stats.batches += 1

        def answered(ch, req) -> None:
            self.stats.requests += 1
            self.stats.tokens += req.num_tokens

        def failed(ch, req, exc) -> None:
            log.exception("%s: answer to client %d failed", self.server_id, ch.client_id)
            self._reject(ch, req, int(ResponseStatus.SERVER_ERROR), f"{exc}")

        answer_layer(layer, items, self.buffers, answered, failed)
        self.stats.last_served = time.monotonic()
        for local, n in enumerate(counts.tolist()):
            if n:
                self.stats.expert_load[(layer_id, layer.slots[local])] += n

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Runs the loop in a background thread (its waits release the GIL)."""
        if self._thread is not None:
            raise RuntimeError(f"{self.server_id} is already running")
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop, name=f"{self.server_id}-loop", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.step(IDLE_WAKE_S)
        except BaseException as exc:  # the loop must never die silently
            log.exception("%s: the serving loop failed", self.server_id)
            self._fail(f"serving loop failed: {type(exc).__name__}: {exc}")

    def _fail(self, reason: str) -> None:
        """Something escaped the loop: the server cannot serve any more. It says so in /health,
        withdraws its membership registration, and tells its clients at once; a supervisor
        (``moecomm expert-server`` exits non-zero) restarts it."""
        self.health.fail(reason)
        if self._registration is not None:
            try:
                self._registration.close(deregister=True)
            except Exception:
                log.exception("%s: withdrawing the registration failed", self.server_id)
            self._registration = None
        self.clients.close_all()

    def wake(self) -> None:
        """Wakes the loop from its doorbell sleep (it then polls every client at once)."""
        self.doorbells.ring()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None and self.health.ok:
            self.wake()  # a failed loop is on its way out already (its doorbell may be gone)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self) -> None:
        self.placement.close()
        self.exports.close()
        if self._watcher is not None:
            self._watcher.close()
        if self._registration is not None:
            self._registration.close(deregister=True)
        self.stop()
        self.clients.close_all()
        self.doorbells.close()
        if self.shm_probe is not None:
            self.shm_probe.close()

    def drain(self) -> None:
        """Graceful drain: accept no new client, answer every request from now on with
        DRAINING (clients re-send it to a replica at once); the batch being computed finishes.
        Members of the membership see an update with metadata draining=1."""
        self.draining = True
        if self._registration is not None:
            m = self._registration.member
            self._registration.update(replace(m, metadata={**m.metadata, "draining": "1"}))

    def join_membership(self, membership, control_url: str, ttl: float) -> None:
        """Registers this server (role "server", its control URL and hosted experts) with a
        lease of `ttl`, and frees the slots of any client the membership reports lost."""
        from moecomm.membership import Member

        # What a peer needs to connect: the control URL (the handshake there carries the
        # transport's handles) and the transports this server speaks.
        member = Member(
            "server",
            self.server_id,
            {"control": control_url},
            self.hosted_ids(),
            {"transports": ",".join(self.served_transports())},
        )
        self._registration = membership.register(member, ttl)
        self._watcher = membership.watch(
            role="client", callback=self._on_client_event, initial=False
        )

    def hosted_ids(self) -> dict[int, list[int]]:
        """{layer: the experts clients may route here} (no local indices)."""
        return self.placement.hosted_ids()

    def _publish_membership(self) -> None:
        """After a placement change: the membership record lists what this server hosts now."""
        reg = self._registration
        if reg is None:
            return
        try:
            reg.update(replace(reg.member, experts=self.hosted_ids()))
        except Exception:  # the clients learn the table from the doorbell epoch anyway
            log.exception("%s: publishing the placement to the membership failed", self.server_id)

    # ------------------------------------------------------------------ placement changes
    def load_expert(self, layer_id: int, expert: int, weights: ExpertWeights | None = None) -> dict:
        """Starts hosting `expert` of `layer_id` (weights given, or read from the weight
        source); clients route to it once they see the new epoch. Returns bytes and seconds."""
        if self.draining or not self.health.ok:
            raise MoecommError(f"{self.server_id} is draining or unhealthy: it loads nothing")
        start = time.perf_counter()
        if weights is None:
            if self.weight_source is None:
                raise MoecommError(
                    f"{self.server_id} has no checkpoint to load experts from; pull the "
                    "weights from a peer instead"
                )
            weights = self.weight_source(layer_id, expert)
        out = self.placement.add(layer_id, expert, weights)
        nbytes = sum(t.numel() * t.element_size() for t in (weights.w1, weights.w3, weights.w2))
        return {**out, "bytes": nbytes, "seconds": time.perf_counter() - start}

    def unload_expert(self, layer_id: int, expert: int) -> dict:
        """Stops publishing `expert`; it is freed once no client can route to it any more."""
        return self.placement.unload(layer_id, expert)

    def export_expert(self, layer_id: int, expert: int, transport: str | None = None) -> dict:
        """Copies a hosted expert into a transport region a peer can read (see weights.py)."""
        layer = self.layers.get(layer_id)
        if layer is None or layer.local_of(expert) is None:
            raise KeyError(f"{self.server_id} hosts no expert {expert} of layer {layer_id}")
        t = self.transports.get(transport) if transport else self.transport
        return self.exports.export(layer.weights(expert), t)

    def load_experts(self, items: list[tuple[int, int, ExpertWeights | None]]) -> dict:
        """Starts hosting every (layer, expert, weights) of `items` at once (weights None: read
        from the weight source): each layer is rebuilt once and the table published in one
        epoch. Returns bytes, the seconds spent reading weights and building, and the epoch."""
        if self.draining or not self.health.ok:
            raise MoecommError(f"{self.server_id} is draining or unhealthy: it loads nothing")
        start = time.perf_counter()
        if any(w is None for _, _, w in items) and self.weight_source is None:
            raise MoecommError(
                f"{self.server_id} has no checkpoint to load experts from; pull the "
                "weights from a peer instead"
            )
        full = [(la, e, w if w is not None else self.weight_source(la, e)) for la, e, w in items]
        read = time.perf_counter()
        out = self.placement.add_many(full)
        nbytes = sum(t.numel() * t.element_size() for _, _, w in full for t in (w.w1, w.w3, w.w2))
        done = time.perf_counter()
        return {
            **out,
            "bytes": nbytes,
            "read_seconds": read - start,
            "build_seconds": done - read,
            "seconds": done - start,
        }

    def unload_experts(self, items: list[tuple[int, int]]) -> dict:
        """Stops publishing every (layer, expert) of `items`, in one epoch."""
        return self.placement.unload_many(items)

    def export_experts(self, items: list[tuple[int, int]], transport: str | None = None) -> dict:
        """Copies hosted experts into one transport region a peer reads at once (weights.py)."""
        ws = []
        for layer_id, expert in items:
            layer = self.layers.get(layer_id)
            if layer is None or layer.local_of(expert) is None:
                raise KeyError(f"{self.server_id} hosts no expert {expert} of layer {layer_id}")
            ws.append(layer.weights(expert))
        t = self.transports.get(transport) if transport else self.transport
        return self.exports.export_many(ws, t)

    def _on_client_event(self, event) -> None:
        if event.kind != "loss":
            return
        try:
            client_id = int(event.member.member_id)
        except ValueError:
            return  # not one of ours: client ids are integers
        self.disconnect(client_id)

    def health_check(self) -> dict:
        """A real forward pass through one hosted expert (not a port check), and the state of
        the serving loop: a server whose loop failed is not ok, with the reason."""
        if not self.health.ok:
            return {"ok": False, "reason": self.health.reason, **self._activity()}
        layer_id = min(self.layers)
        layer = self.layers[layer_id]
        x = torch.ones(1, self.hidden, dtype=layer.dtype)
        ids = torch.full((1, 1), layer.local_of(layer.logical_ids[0]), dtype=torch.int32)
        start = time.perf_counter()
        (y,) = layer.forward([x], [ids], [torch.ones(1, 1)])
        ms = (time.perf_counter() - start) * 1e3
        ok = bool(torch.isfinite(y).all())
        out = {"ok": ok, "layer": layer_id, "expert": layer.logical_ids[0], "forward_ms": ms}
        if not ok:
            out["reason"] = "the health forward pass produced non-finite values"
        return {**out, **self._activity()}

    def _activity(self) -> dict:
        since = self.stats.seconds_since_last_served()
        return {
            "batch_failures": self.stats.batch_failures,
            "rejected": self.stats.rejected,
            "dead_clients_dropped": self.stats.dead_clients_dropped,
            "seconds_since_last_served": None if since is None else round(since, 3),
        }
