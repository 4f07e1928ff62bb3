"""The expert server: hosts experts of any layers, answers clients over the slot protocol.

A loop with no client coupling (DESIGN.md, "Expert server"): poll every client's request slots,
take every ready one (optionally waiting a batching window for more), reorganize the tokens of
all ready batches of a layer together, run the grouped expert MLP over the active experts only,
write each client's response and signal it with the request's sequence number. An idle server
sleeps on one shared doorbell; every wait has a deadline. A malformed request gets an error
response and the loop goes on serving everyone else.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from moecomm import _C
from moecomm.errors import MoecommError
from moecomm.ops.quant import dequantize
from moecomm.protocol import ENCODING_DTYPE, ResponseStatus, SlotLayout
from moecomm.runtime.experts import ExpertWeights, LayerExperts
from moecomm.slots import Request, ServerChannel
from moecomm.transport import ShmTransport, Transport, WaitStatus, reap_stale_segments

# An idle server wakes this often to check that its clients are still alive.
IDLE_WAKE_S = 0.1
# Limits on what a client may ask for at connect time: they bound the memory one connect costs.
MAX_SLOTS_PER_CLIENT = 16
MAX_REGION_BYTES = 1 << 30


@dataclass
class ServerStats:
    requests: int = 0
    rejected: int = 0
    tokens: int = 0
    batches: int = 0
    busy_s: float = 0.0
    # (layer, logical expert) -> token copies served
    expert_load: dict = field(default_factory=lambda: defaultdict(int))


class ExpertServer:
    """Hosts `experts` = {layer: {logical expert: ExpertWeights}} (any subset of any layers)."""

    def __init__(
        self,
        experts: Mapping[int, Mapping[int, ExpertWeights]],
        server_id: str = "expert-server",
        transport: Transport | None = None,
        batching_window_s: float = 0.0,
        link_delay_s: float = 0.0,
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
        self.transport = transport or ShmTransport()
        self.batching_window_s = batching_window_s
        if link_delay_s < 0:
            raise ValueError(f"link_delay_s must be >= 0, got {link_delay_s}")
        # Benchmarks only: emulates a network link of this one-way delay (see _DelayedLink).
        self._link = _DelayedLink(link_delay_s) if link_delay_s > 0 else None
        self.doorbell = self.transport.create_region(_C.DOORBELL_BYTES)
        self.stats = ServerStats()
        self._channels: dict[int, ServerChannel] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.draining = False
        self._registration = None  # membership registration (see join_membership)
        self._watcher = None

    # ------------------------------------------------------------------ membership of clients
    def hosted(self) -> dict[int, list[int]]:
        return {k: list(le.logical_ids) for k, le in sorted(self.layers.items())}

    def connect(
        self, client_id: int, client_handle: str, layout: SlotLayout, num_slots: int
    ) -> dict:
        """Allocates request slots for a client and attaches to its response slots. A client
        that connects again (it restarted) gets fresh slots."""
        if self.draining:
            raise MoecommError(f"{self.server_id} is draining and accepts no new clients")
        if layout.hidden != self.hidden:
            raise ValueError(f"hidden {layout.hidden} does not match this server's {self.hidden}")
        if not 1 <= num_slots <= MAX_SLOTS_PER_CLIENT:
            raise ValueError(f"num_slots must be in [1, {MAX_SLOTS_PER_CLIENT}], got {num_slots}")
        need = _C.SlotRing(layout.config, num_slots, True).region_bytes
        if need > MAX_REGION_BYTES:
            raise ValueError(
                f"the slot layout needs {need} bytes per client, over the "
                f"{MAX_REGION_BYTES}-byte limit"
            )
        channel = ServerChannel(
            self.transport, layout, client_id, num_slots, name=f"client {client_id}"
        )
        try:
            channel.connect(client_handle)
        except Exception:
            channel.close()
            raise
        with self._lock:
            old = self._channels.pop(client_id, None)
            self._channels[client_id] = channel
        if old is not None:
            old.close()
        return {
            "server_id": self.server_id,
            "server_handle": channel.handle,
            "transport": self.transport.name,
            "doorbell_handle": self.doorbell.handle,
            "num_slots": num_slots,
            "request_slot_bytes": layout.request_slot_bytes,
            "slot_offsets": [channel.request_ring.slot_offset(s) for s in range(num_slots)],
            "hosted": self.hosted(),
        }

    def disconnect(self, client_id: int) -> bool:
        with self._lock:
            channel = self._channels.pop(client_id, None)
        if channel is None:
            return False
        channel.mark_offline()
        channel.close()
        return True

    @property
    def num_clients(self) -> int:
        with self._lock:
            return len(self._channels)

    # ------------------------------------------------------------------ the loop
    def step(self, timeout: float = IDLE_WAKE_S) -> int:
        """One pass of the loop: serves every ready request, or sleeps up to `timeout` for one.
        Returns how many requests were answered (errors included)."""
        seen = self.transport.load(self.doorbell, 0)
        ready = self._poll()
        if self._link is not None:
            ready = self._link.arrive(ready)
            timeout = min(timeout, self._link.next_event_in())
        if not ready:
            status, _ = _C.wait_doorbell(self.transport, self.doorbell, seen, int(timeout * 1e9))
            if status == WaitStatus.TIMEOUT and self._link is None:
                self._drop_dead_clients()
                return 0
            ready = self._poll()
            if self._link is not None:
                ready = self._link.arrive(ready)
        if ready and self.batching_window_s > 0 and self._link is None:
            time.sleep(self.batching_window_s)
            ready = self._poll()
        served = self._serve(ready)
        if self._link is not None:
            self._link.flush()
        return served

    def _poll(self) -> list[tuple[ServerChannel, Request]]:
        with self._lock:
            channels = list(self._channels.values())
        return [(ch, req) for ch in channels for req in ch.poll()]

    def _drop_dead_clients(self) -> None:
        with self._lock:
            dead = [
                cid
                for cid, ch in self._channels.items()
                if not self.transport.peer_alive(ch.client)
            ]
        for cid in dead:
            self.disconnect(cid)
        if dead:
            reap_stale_segments()

    def _serve(self, ready: list[tuple[ServerChannel, Request]]) -> int:
        start = time.perf_counter()
        by_layer: dict[int, list[tuple[ServerChannel, Request]]] = defaultdict(list)
        for ch, req in ready:
            problem = self._check(req)
            if problem is not None:
                status, reason = problem
                ch.reject(req, status, reason)
                self.stats.rejected += 1
            else:
                by_layer[req.layer_id].append((ch, req))
        for layer_id, items in by_layer.items():
            self._run_layer(layer_id, items)
        self.stats.busy_s += time.perf_counter() - start
        return len(ready)

    def _check(self, req: Request):
        if not req.valid:
            return int(req.code), _C.validate_reason(req.code)
        if self.draining:
            return int(ResponseStatus.DRAINING), f"{self.server_id} is draining"
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
        xs, ids, scores = [], [], []
        for _, req in items:
            x = req.activations
            if req.scales is not None:
                x = dequantize(x, req.scales, req.encoding, dtype=torch.float32)
            xs.append(x)
            ids.append(req.expert_ids)
            scores.append(req.scores)
        try:
            ys = layer.forward(xs, ids, scores)
        except Exception as exc:  # a compute failure answers every request of the batch
            for ch, req in items:
                ch.reject(
                    req,
                    int(ResponseStatus.SERVER_ERROR),
                    f"{self.server_id} layer {layer_id}: {exc}",
                )
                self.stats.rejected += 1
            return
        self.stats.batches += 1
        counts = torch.zeros(layer.num_local, dtype=torch.int64)
        for (ch, req), y in zip(items, ys, strict=True):
            y = y.to(ENCODING_DTYPE[ch.layout.out_encoding])
            if self._link is not None:
                self._link.send_later(ch, req, y)
            else:
                ch.respond(req, y)
            self.stats.requests += 1
            self.stats.tokens += req.num_tokens
            valid = req.expert_ids[req.expert_ids >= 0].to(torch.int64)
            counts += torch.bincount(valid, minlength=layer.num_local)
        for local, n in enumerate(counts.tolist()):
            if n:
                self.stats.expert_load[(layer_id, layer.logical_ids[local])] += n

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
        while not self._stop.is_set():
            self.step(IDLE_WAKE_S)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
        if self._registration is not None:
            self._registration.close(deregister=True)
        self.stop()
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for ch in channels:
            ch.mark_offline()
            ch.close()
        self.doorbell.close()

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

        member = Member(
            "server",
            self.server_id,
            {"control": control_url},
            {layer: list(ids) for layer, ids in self.hosted().items()},
        )
        self._registration = membership.register(member, ttl)
        self._watcher = membership.watch(
            role="client", callback=self._on_client_event, initial=False
        )

    def _on_client_event(self, event) -> None:
        if event.kind != "loss":
            return
        try:
            client_id = int(event.member.member_id)
        except ValueError:
            return  # not one of ours: client ids are integers
        self.disconnect(client_id)

    def health_check(self) -> dict:
        """A real forward pass through one hosted expert (not a port check)."""
        layer_id = min(self.layers)
        layer = self.layers[layer_id]
        x = torch.ones(1, self.hidden, dtype=layer.dtype)
        ids = torch.zeros(1, 1, dtype=torch.int32)
        start = time.perf_counter()
        (y,) = layer.forward([x], [ids], [torch.ones(1, 1)])
        ms = (time.perf_counter() - start) * 1e3
        ok = bool(torch.isfinite(y).all())
        return {"ok": ok, "layer": layer_id, "expert": layer.logical_ids[0], "forward_ms": ms}


class _DelayedLink:
    """Emulates a network link with a fixed one-way delay, for the overlap benchmark: a request
    becomes visible `delay` after it was first seen, and a response is written `delay` after it
    was computed. Requests and responses in flight overlap their delays, as on a real link."""

    def __init__(self, delay_s: float):
        self.delay = delay_s
        self._inbound: dict[tuple, tuple[float, ServerChannel, Request]] = {}
        self._outbound: list[tuple[float, ServerChannel, Request, torch.Tensor]] = []
        self._answered: set[tuple] = set()

    def arrive(self, ready):
        now = time.monotonic()
        for ch, req in ready:
            key = (ch.client_id, req.slot, req.seq)
            if key not in self._inbound and key not in self._answered:
                self._inbound[key] = (now + self.delay, ch, req)
        due = [k for k, (t, _, _) in self._inbound.items() if t <= now]
        out = []
        for k in due:
            _, ch, req = self._inbound.pop(k)
            self._answered.add(k)
            out.append((ch, req))
        return out

    def send_later(self, ch, req, y) -> None:
        self._outbound.append((time.monotonic() + self.delay, ch, req, y.clone()))

    def flush(self) -> None:
        now = time.monotonic()
        keep = []
        for item in self._outbound:
            t, ch, req, y = item
            if t <= now:
                ch.respond(req, y)
                self._answered.discard((ch.client_id, req.slot, req.seq))
            else:
                keep.append(item)
        self._outbound = keep

    def next_event_in(self) -> float:
        times = [t for t, _, _ in self._inbound.values()] + [t for t, *_ in self._outbound]
        return max(0.0, min(times) - time.monotonic()) if times else float("inf")
