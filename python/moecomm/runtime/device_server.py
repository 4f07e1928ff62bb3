"""The GPU expert server: experts in GPU memory, clients whose slots live in GPU memory.

The same server as :class:`moecomm.runtime.ExpertServer` — the same loop thread, control plane,
membership registration, drain, health, metrics and statistics — with the data path on the
device. One pass of the loop, per hosted layer, on the server's own stream:

1. ``server_gather`` (``csrc/kernels/cuda/server_kernels.cuh``): polls every (client, slot)
   entry, validates headers (wrong layer, unknown expert, draining: an error answer; a payload
   still landing: left for the next pass), concatenates the admitted requests, reorganizes their
   rows per local expert and group-shrinks the expert list;
2. the grouped expert MLP in Triton (:func:`moecomm.ops.triton_moe.triton_grouped_mlp_contiguous`)
   straight from the gathered rows — fp8 rows with their scales applied inside the K loop —,
   each row times its router score;
3. ``server_respond``: per-token sums in k order, the answers put into each client's response
   slot (the request slot released first), the signal raised by the last put warp.

The host reads one small status block per pass (entries served, rejected; tokens per expert)
for the statistics and the idle back-off; it never reads a count it would need to launch.
Clients connect over CUDA IPC (same node; the handshake carries the IPC handles, see
runtime/device_handshake.py). Every client shares the server's slot layout, fixed at start.

Before the loop starts (and before ``moecomm expert-server`` says it listens), :meth:`warm_up`
runs every hosted layer's expert MLP as a pass calls it, on a one-row batch, and one empty pass:
Triton's JIT compiles take seconds on a cold cache, longer than a client's combine deadline, and
would otherwise fall on the first request and get a healthy server evicted.

The payload wait of the gather (:func:`moecomm.wire.cuda.arrival_timeout_ns`:
``ARRIVAL_TIMEOUT_NS`` times :func:`moecomm.wire.cuda.deadline_scale`) is shared with the DeepEP
adapter; ``MOECOMM_DEVICE_DEBUG=1`` records the device waits and prints them with the entry
states when a pass fails (:mod:`moecomm.runtime.device_debug`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import torch

import moecomm.wire.cuda
from moecomm import _C
from moecomm.errors import MoecommError
from moecomm.ops.grouped_gemm import DEFAULT_BLOCK_M
from moecomm.ops.quant import QUANTIZED_ENCODINGS, scales_per_token
from moecomm.runtime import device_debug
from moecomm.runtime.device_preload import preload_kernels
from moecomm.runtime.experts import ExpertWeights
from moecomm.runtime.registry import (
    ClientIdInUseError,
    UnknownSessionError,
    new_session_secret,
    same_session,
)
from moecomm.runtime.server import CLIENT_CHECK_S, MAX_SLOTS_PER_CLIENT, ExpertServer
from moecomm.wire.choose import boot_id
from moecomm.wire.protocol import ENCODING_DTYPE, SlotLayout, as_encoding

log = logging.getLogger("moecomm.device_server")

__all__ = ["DeviceExpertServer"]

# Idle back-off: a pass that served nothing sleeps, doubling up to this (the latency an idle
# server adds to its first request; a busy one never sleeps).
MAX_IDLE_SLEEP_S = 1e-3
MIN_IDLE_SLEEP_S = 20e-6
# EntryState is 8 int32 (dispatch_index.h): action, code, num_tokens, ...
_ENTRY_WORDS = device_debug.ENTRY_WORDS
_ACTION_SERVE, _ACTION_REJECT = 1, 2
# The warm-up batch: one row, to local expert 0 (what matters is that every kernel a pass
# launches is compiled and loaded, with the step's shapes and dtypes, before the first client).
WARM_UP_ROWS = 1


class DeviceExpertServer(ExpertServer):
    """Hosts ``experts`` ({layer: {expert: ExpertWeights}}, any subset of any layers, the same
    number of experts per hosted layer) on ``device`` for up to ``max_clients`` CUDA-IPC
    clients of ``layout``. ``max_step_tokens`` bounds one pass (default: every client's every
    slot full)."""

    def __init__(
        self,
        experts: Mapping[int, Mapping[int, ExpertWeights]],
        layout: SlotLayout,
        device: torch.device | str = "cuda",
        server_id: str = "expert-server",
        max_clients: int = 8,
        num_slots: int = 2,
        max_step_tokens: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        self._k = moecomm.wire.cuda.cuda_module()  # a clear error without a build or a device
        super().__init__(experts, server_id=server_id, transport="shm")
        if layout.hidden != self.hidden:
            raise ValueError(f"layout hidden {layout.hidden} != the experts' {self.hidden}")
        if not 1 <= num_slots <= MAX_SLOTS_PER_CLIENT or max_clients < 1:
            raise ValueError("num_slots must be in [1, 16] and max_clients >= 1")
        sizes = {le.num_local for le in self.layers.values()}
        if len(sizes) != 1:
            raise ValueError(
                "the GPU server hosts the same number of experts in every layer, got "
                f"{sorted(sizes)}"
            )
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.layout, self.num_slots, self.max_clients = layout, num_slots, max_clients
        self.num_experts = sizes.pop()
        # Weights on the device, stacked per layer: gate|up [E, 2I, H], down [E, H, I].
        self.weights = {
            layer: (le.w13.to(self.device, dtype), le.w2.to(self.device, dtype))
            for layer, le in self.layers.items()
        }
        self.stream = torch.cuda.Stream(self.device)
        # Every kernel loaded before this server says it listens (runtime/device_preload.py).
        preload_kernels(self._k, self.device.index)
        self.ipc = self._k.IpcTransport(self.device.index)
        ring = _C.SlotRing(layout.config, num_slots, True)
        self.ring_bytes = ring.region_bytes
        self.region = self.ipc.create_region(self.ring_bytes * max_clients)
        self.table = self._k.IpcPeerTable(
            self.ipc, self.region, max_clients, [self.stream.cuda_stream]
        )
        dev, i64 = self.device, torch.int64
        self.client_ids = torch.zeros(max_clients, dtype=i64, device=dev)
        self.request_ring_offset = torch.arange(max_clients, dtype=i64, device=dev)
        self.request_ring_offset.mul_(self.ring_bytes)
        self.response_ring_offset = torch.zeros(max_clients, dtype=i64, device=dev)
        cfg = self._k.ServerConfig()
        cfg.num_clients, cfg.num_slots, cfg.num_experts = max_clients, num_slots, self.num_experts
        cfg.max_tokens, cfg.hidden, cfg.topk = layout.max_tokens, layout.hidden, layout.topk
        cfg.encoding, cfg.out_encoding = int(layout.encoding), int(layout.out_encoding)
        cfg.max_step_tokens = max_step_tokens or layout.max_tokens * num_slots * max_clients
        cfg.client_ids = self.client_ids.data_ptr()
        cfg.request_ring_offset = self.request_ring_offset.data_ptr()
        cfg.response_ring_offset = self.response_ring_offset.data_ptr()
        self.config = cfg
        self.ws_layout = self._k.server_workspace_layout(cfg)
        self.workspace = torch.zeros(self.ws_layout["total"], dtype=torch.uint8, device=dev)
        num_layers = max(self.layers) + 1
        hosted = torch.zeros(num_layers, dtype=torch.uint8)
        hosted[list(self.layers)] = 1
        self.layer_hosted = hosted.to(dev)
        # Per pass and layer: the entries and the expert histogram, copied out asynchronously.
        b = max_clients * num_slots
        self._entries_out = torch.zeros(len(self.layers), b, _ENTRY_WORDS, dtype=torch.int32,
                                        device=dev)  # fmt: skip
        self._counts_out = torch.zeros(len(self.layers), self.num_experts, dtype=torch.int32,
                                       device=dev)  # fmt: skip
        self._clients: dict[int, tuple[int, str]] = {}  # peer index -> (client id, session)
        self._lock = threading.Lock()  # connects change the tables the loop launches with
        self._idle_sleep = MIN_IDLE_SLEEP_S
        self._warm = False
        # The debug mode's wait trace, handed to every launch (None: nothing recorded).
        self._trace = device_debug.WaitTraceBuffer(dev) if device_debug.enabled() else None

    # ------------------------------------------------------------------ what is served
    def served_transports(self) -> list[str]:
        return ["cuda_ipc"]

    def offer(self) -> dict:
        props = torch.cuda.get_device_properties(self.device)
        return {
            "transports": self.served_transports(),
            "boot_id": boot_id(),
            "device": {"name": props.name, "uuid": str(getattr(props, "uuid", ""))},
            # Clients of the GPU path must use exactly this layout.
            "layout": self.layout.to_dict(),
            "num_slots": self.num_slots,
        }

    @property
    def num_clients(self) -> int:
        return len(self._clients)

    # ------------------------------------------------------------------ clients
    def connect(
        self,
        client_id: int,
        client_handle: str,
        layout: SlotLayout,
        num_slots: int,
        session: str = "",
        transport: str | None = None,
        response_ring_offset: int = 0,
    ) -> dict:
        if transport != "cuda_ipc":
            raise MoecommError(
                f"{self.server_id} runs on {self.device} (--device cuda) and serves cuda_ipc "
                f"clients (a DeviceClient, `moecomm frontend --device cuda`), not {transport!r}"
            )
        if self.draining or not self.health.ok:
            raise MoecommError(f"{self.server_id} is draining or unhealthy: no new clients")
        if layout != self.layout or num_slots != self.num_slots:
            raise ValueError(
                f"{self.server_id} serves the slot layout {self.layout.to_dict()} with "
                f"{self.num_slots} slots; the client asked for {layout.to_dict()} with {num_slots}"
            )
        resp_bytes = _C.SlotRing(layout.config, num_slots, False).region_bytes
        if response_ring_offset < 0 or response_ring_offset % 64:
            raise ValueError(f"response_ring_offset {response_ring_offset} is not 64-byte aligned")
        with self._lock:
            for index, (cid, secret) in list(self._clients.items()):
                if cid == client_id:
                    alive = self.ipc.peer_alive(self.table.peer_region(index))
                    if alive and not same_session(session, secret):
                        raise ClientIdInUseError(f"client id {client_id} is held by a live client")
                    self._remove(index)
            index = self.table.add_peer(client_handle)  # refuses another node, a dead owner
            try:
                peer = self.table.peer_region(index)
                if peer.size < response_ring_offset + resp_bytes:
                    raise ValueError(
                        f"the client's region ({peer.size} bytes) has no response ring of "
                        f"{resp_bytes} bytes at offset {response_ring_offset}"
                    )
                # A fresh ring: idle signal words, zero arrival counters, for a new client.
                self.ipc.write(self.region, index * self.ring_bytes, bytes(self.ring_bytes))
                self._reset_entries(index)
                self.client_ids[index] = client_id
                self.response_ring_offset[index] = response_ring_offset
                torch.cuda.synchronize(self.device)
            except BaseException:
                self.table.remove_peer(index, [self.stream.cuda_stream])
                raise
            secret = new_session_secret()
            self._clients[index] = (client_id, secret)
        return {
            "server_id": self.server_id,
            "transport": "cuda_ipc",
            "server_handle": self.region.handle,
            "request_ring_offset": index * self.ring_bytes,
            "num_slots": num_slots,
            "hosted": {str(k): v for k, v in self.hosted().items()},
            "session": secret,
        }

    def _reset_entries(self, index: int) -> None:
        """The server's per-entry protocol state of peer `index` starts from zero."""
        lay = self.ws_layout
        first, n = index * self.num_slots, self.num_slots
        for name, width in (("arrival_sent", 8), ("done_warps", 8)):
            start = lay[name] + first * width
            self.workspace[start : start + n * width].zero_()

    def _remove(self, index: int) -> None:
        self._clients.pop(index, None)
        self.client_ids[index] = 0
        self.table.remove_peer(index, [self.stream.cuda_stream])

    def disconnect(self, client_id: int, session: str | None = None) -> bool:
        with self._lock:
            for index, (cid, secret) in list(self._clients.items()):
                if cid == client_id:
                    if session is not None and not same_session(session, secret):
                        raise UnknownSessionError(f"client {client_id}: not this session")
                    self._remove(index)
                    return True
        return False

    def _drop_dead_clients(self) -> None:
        self._next_client_check = time.monotonic() + CLIENT_CHECK_S
        with self._lock:
            dead = [i for i in self._clients if not self.ipc.peer_alive(self.table.peer_region(i))]
            for index in dead:
                self.table.mark_dead(index)
                self._remove(index)
        self.stats.dead_clients_dropped += len(dead)

    # ------------------------------------------------------------------ the loop
    def warm_up(self) -> float:
        """Compiles and loads everything a pass runs, before any client can connect: per hosted
        layer, the step's expert MLP (the same call on the same workspace views, so the same
        Triton specializations) on a one-row batch of the server's encoding, then one pass of
        gather and respond with no client (nothing is read or answered). Returns the seconds it
        took; runs once (start() calls it)."""
        if self._warm:
            return 0.0
        start = time.perf_counter()
        offsets = self._part("offsets", torch.int64, (self.num_experts + 1,))
        with self._lock, torch.cuda.stream(self.stream):
            for i, layer in enumerate(sorted(self.layers)):
                offsets.zero_()
                offsets[1:] = WARM_UP_ROWS  # rows [0, 1) to local expert 0, the others empty
                out = self._expert_mlp(layer)
                if not bool(torch.isfinite(out[:WARM_UP_ROWS]).all()):  # synchronizes
                    raise MoecommError(
                        f"{self.server_id}: the warm-up forward of layer {layer} produced "
                        "non-finite values"
                    )
                self._run_device_layer(i, layer)
            self.stream.synchronize()
        self._warm = True
        seconds = time.perf_counter() - start
        log.info("%s: warm in %.1f s (%d layers)", self.server_id, seconds, len(self.layers))
        return seconds

    def start(self) -> None:
        """Warms up (:meth:`warm_up`), then runs the loop."""
        self.warm_up()
        super().start()

    def step(self, timeout: float = 0.1) -> int:
        if time.monotonic() >= self._next_client_check:
            self._drop_dead_clients()
        try:
            with self._lock, torch.cuda.stream(self.stream):
                for i, layer in enumerate(sorted(self.layers)):
                    self._run_device_layer(i, layer)
                self.stream.synchronize()
                entries = self._entries_out.cpu()
                counts = self._counts_out.cpu()
        except Exception as exc:
            if self._trace is not None:
                self.debug_report(f"a pass failed: {type(exc).__name__}: {exc}")
            raise
        if self._trace is not None and bool((entries[..., 0] == _ACTION_REJECT).any()):
            self.debug_report("a pass rejected requests", entries)
        served = self._account(entries, counts)
        if served == 0:
            time.sleep(min(self._idle_sleep, timeout))
            self._idle_sleep = min(self._idle_sleep * 2, MAX_IDLE_SLEEP_S)
        else:
            self._idle_sleep = MIN_IDLE_SLEEP_S
        return served

    def _part(self, name: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        start = self.ws_layout[name]
        n = 1
        for s in shape:
            n *= s
        size = n * torch.empty((), dtype=dtype).element_size()
        return self.workspace[start : start + size].view(dtype).view(shape)

    def _peers(self):
        """The kernels' view of the client table, with the debug trace when the mode is on."""
        return device_debug.attach(self.table.kernel_peers(), self._trace)

    def _gather_args(self, layer: int):
        g = self._k.ServerGatherArgs()
        g.layer_id, g.num_layers = layer, self.layer_hosted.shape[0]
        g.layer_hosted, g.workspace = self.layer_hosted.data_ptr(), self.workspace.data_ptr()
        g.arrival_timeout_ns, g.block_m = moecomm.wire.cuda.arrival_timeout_ns(), DEFAULT_BLOCK_M
        g.draining = self.draining
        return g

    def _run_device_layer(self, i: int, layer: int) -> None:
        k, stream = self._k, self.stream.cuda_stream
        peers = self._peers()
        k.server_gather(peers, self.config, self._gather_args(layer), stream)
        out = self._expert_mlp(layer)
        if self._trace is not None:
            self._debug_sync(f"the expert MLP of layer {layer}")
        r = k.ServerRespondArgs()
        r.expert_out, r.expert_out_dtype = out.data_ptr(), int(as_encoding(out.dtype))
        r.workspace = self.workspace.data_ptr()
        k.server_respond(peers, self.config, r, stream)
        b, e = self.max_clients * self.num_slots, self.num_experts
        self._entries_out[i].copy_(self._part("entries", torch.int32, (b, _ENTRY_WORDS)))
        self._counts_out[i].copy_(self._part("counts", torch.int32, (e,)))

    def _expert_mlp(self, layer: int) -> torch.Tensor:
        """The pass's grouped expert MLP of `layer` on the gathered rows (workspace views):
        score-weighted outputs in layout order."""
        lay = self.ws_layout
        rows_n, hidden, e = lay["max_rows"], self.hidden, self.num_experts
        enc = self.layout.encoding
        rows = self._part("rows", ENCODING_DTYPE[enc], (rows_n, hidden))
        offsets = self._part("offsets", torch.int64, (e + 1,))
        scores = self._part("row_scores", torch.float32, (rows_n,))
        x_scales = None
        spt = scales_per_token(enc, hidden) if enc in QUANTIZED_ENCODINGS else 0
        if spt:
            t = self.config.max_step_tokens
            token_scales = self._part("scales", torch.float32, (t, spt))
            src = self._part("src_token", torch.int64, (rows_n,))
            x_scales = token_scales.index_select(0, src)
        from moecomm.ops.triton_moe import triton_grouped_mlp_contiguous

        w13, w2 = self.weights[layer]
        return triton_grouped_mlp_contiguous(rows, offsets, w13, w2, scores, x_scales=x_scales)

    # ------------------------------------------------------------------ debugging
    def _debug_sync(self, what: str) -> None:
        """Debug mode: the device work queued so far has finished without an error (a fault
        is raised naming `what`, not some later call)."""
        try:
            self.stream.synchronize()
        except Exception as exc:
            raise MoecommError(f"{self.server_id}: device debug: {what} failed: {exc}") from exc

    def debug_report(self, title: str, entries: torch.Tensor | None = None) -> str:
        """Prints (stderr) and returns the server's entry states (of the last pass, or
        `entries`), its clients and, in the debug mode, its recorded device waits; never
        raises."""
        clients = {i: cid for i, (cid, _) in self._clients.items()}
        sections = {
            "clients": "\n".join(f"    client {i}: id {c:#x}" for i, c in sorted(clients.items()))
            or "    (none)"
        }
        try:
            rows = (entries if entries is not None else self._entries_out.cpu()).view(
                len(self.layers), -1, _ENTRY_WORDS
            )
            for i, layer in enumerate(sorted(self.layers)):
                sections[f"entry states, layer {layer}"] = device_debug.format_entries(
                    device_debug.decode_entries(rows[i]), self.num_slots, clients
                )
        except Exception as exc:  # a sticky CUDA error makes every device read fail
            sections["entry states"] = device_debug.unreadable(exc)
        sections["device waits"] = device_debug.trace_section(self._trace)
        return device_debug.report(f"server {self.server_id}: {title}", sections)

    def _account(self, entries: torch.Tensor, counts: torch.Tensor) -> int:
        """Statistics of one pass from the copied entry states; returns entries answered."""
        actions, codes, tokens = entries[..., 0], entries[..., 1], entries[..., 2]
        serve, reject = actions == _ACTION_SERVE, actions == _ACTION_REJECT
        for code in codes[reject].tolist():
            self.stats.count_rejection(int(code))
        n_serve = int(serve.sum())
        if n_serve:
            self.stats.batches += 1
            self.stats.requests += n_serve
            self.stats.tokens += int(tokens[serve].sum())
            self.stats.last_served = time.monotonic()
            for i, layer in enumerate(sorted(self.layers)):
                slots = self.layers[layer].slots
                for local, n in enumerate(counts[i].tolist()):
                    if n:
                        self.stats.expert_load[(layer, slots[local])] += n
        return n_serve + int(reject.sum())

    def wake(self) -> None:
        """The loop polls the device; nothing sleeps on a doorbell to wake."""

    # ------------------------------------------------------------------ not on the GPU path yet
    def load_expert(self, layer_id: int, expert: int, weights=None) -> dict:
        raise MoecommError(
            f"{self.server_id}: live re-placement is not implemented on the GPU server yet "
            "(its experts are fixed at start); restart it with the new placement"
        )

    def unload_expert(self, layer_id: int, expert: int) -> dict:
        return self.load_expert(layer_id, expert)

    def export_expert(self, layer_id: int, expert: int, transport: str | None = None) -> dict:
        return self.load_expert(layer_id, expert)

    def load_experts(self, items) -> dict:
        return self.load_expert(-1, -1)

    def unload_experts(self, items) -> dict:
        return self.load_expert(-1, -1)

    def export_experts(self, items, transport: str | None = None) -> dict:
        return self.load_expert(-1, -1)

    def health_check(self) -> dict:
        """A real forward pass through one hosted expert on the device."""
        if not self.health.ok:
            return {"ok": False, "reason": self.health.reason, **self._activity()}
        from moecomm.ops.triton_moe import triton_grouped_mlp_contiguous

        layer = min(self.layers)
        w13, w2 = self.weights[layer]
        x = torch.ones(1, self.hidden, dtype=w13.dtype, device=self.device)
        offsets = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=self.device)
        offsets[1:] = 1
        start = time.perf_counter()
        y = triton_grouped_mlp_contiguous(x, offsets, w13, w2)
        ok = bool(torch.isfinite(y).all())  # synchronises
        out = {"ok": ok, "layer": layer, "forward_ms": (time.perf_counter() - start) * 1e3}
        if not ok:
            out["reason"] = "the health forward pass produced non-finite values"
        return {**out, **self._activity()}

    def close(self) -> None:
        super().close()
        with self._lock:
            for index in list(self._clients):
                self._remove(index)
