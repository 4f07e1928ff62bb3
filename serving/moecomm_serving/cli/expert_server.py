"""`moecomm expert-server`: host experts of a HF-layout checkpoint behind the slot protocol and
an HTTP control plane, until interrupted."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

import torch
from moecomm.http_thread import DEFAULT_HOST, HttpServer
from moecomm.membership import connect_membership, monitor_token
from moecomm.membership.base import TOKEN_ENV
from moecomm.readiness import announce_ready
from moecomm.runtime.control import make_app
from moecomm.runtime.launch import LOOP_FAILED_EXIT, SERVING_TTL_S
from moecomm.runtime.server import ExpertServer

from moecomm_serving.cli.common import (
    WAKE_S,
    add_threads_argument,
    add_token_argument,
    add_transport_argument,
    set_threads,
)
from moecomm_serving.cli.device import (
    add_device_arguments,
    device_layout,
    is_cuda,
    random_hosted,
    require_gpu,
    start_nvshmem,
)
from moecomm_serving.model.checkpoint import Checkpoint

# A draining server leaves once no request reached it for this long (clients have moved on)...
DRAIN_QUIET_S = 1.0
# ...or after this long in any case.
DRAIN_MAX_S = 30.0


def parse_ids(spec: str, upper: int, what: str) -> list[int]:
    """'all', or a list like '0-3,6,8-9' of values in [0, upper)."""
    if spec == "all":
        return list(range(upper))
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            lo, _, hi = part.partition("-")
            a, b = int(lo), int(hi) if hi else int(lo)
        except ValueError:
            raise SystemExit(f"{what}: cannot parse {part!r} (expected e.g. 0-3,6)") from None
        if not (0 <= a <= b < upper):
            raise SystemExit(f"{what}: {part!r} is outside [0, {upper})")
        out.update(range(a, b + 1))
    return sorted(out)


def graceful_drain(server: ExpertServer) -> None:
    """SIGTERM: tell clients (DRAINING answers and a membership update) to go elsewhere, let the
    traffic stop, then leave — close() deregisters."""
    print(f"expert server {server.server_id}: draining", flush=True)
    server.drain()
    deadline = time.monotonic() + DRAIN_MAX_S
    last, quiet_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        answered = server.stats.requests + server.stats.rejected
        if answered != last:
            last, quiet_since = answered, time.monotonic()
        elif time.monotonic() - quiet_since >= DRAIN_QUIET_S:
            break
        time.sleep(WAKE_S)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (p.description or "") + " SIGTERM drains gracefully; SIGINT stops at once."
    p.add_argument("--checkpoint", default=None, help="HF-layout checkpoint directory")
    add_threads_argument(p)
    p.add_argument(
        "--layers", default="all", help="MoE layers to host, e.g. 0-3 (default: every MoE layer)"
    )
    p.add_argument(
        "--experts",
        default="all",
        help="experts to host in each of those layers, e.g. 0-7 (replicas: give "
        "the same experts to several servers)",
    )
    p.add_argument("--id", default=None, help="server id (default: expert-server-<host>:<port>)")
    p.add_argument("--host", default=DEFAULT_HOST, help="control-plane address (loopback)")
    p.add_argument("--port", type=int, default=0, help="control-plane port (0: any free)")
    add_token_argument(p, help="shared token required to connect")
    add_transport_argument(p)
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="dtype the experts compute in (default float32 on cpu: batch invariant; "
        "bfloat16 on cuda)",
    )
    p.add_argument(
        "--batching-window-ms",
        type=float,
        default=0.0,
        help="wait this long for more requests before a step",
    )
    p.add_argument(
        "--monitor",
        default=None,
        help="membership to register with: http://host:port (moecomm monitor) or etcd://host:port;"
        f" clients then find this server and hear if it dies (token: ${TOKEN_ENV})",
    )
    p.add_argument(
        "--ttl",
        type=float,
        default=SERVING_TTL_S,
        help="membership lease in seconds (a lost server is noticed within it)",
    )
    add_device_arguments(p, server=True)


def load_hosted(args: argparse.Namespace):
    """(hosted experts, layers, experts, weight source) from --checkpoint or --random-experts."""
    if args.dtype is None:
        args.dtype = "bfloat16" if is_cuda(args) else "float32"
    dtype = getattr(torch, args.dtype)
    if (args.checkpoint is None) == (args.random_experts is None):
        raise SystemExit("give exactly one of --checkpoint and --random-experts")
    if args.random_experts is not None:
        every = random_hosted(args.random_experts, dtype)
        num_experts = len(next(iter(every.values())))
        experts = parse_ids(args.experts, num_experts, "--experts")
        layers = parse_ids(args.layers, len(every), "--layers")
        hosted = {layer: {e: every[layer][e] for e in experts} for layer in layers}
        return hosted, layers, experts, None
    ckpt = Checkpoint(args.checkpoint)
    cfg = ckpt.config
    layers = [
        i for i in parse_ids(args.layers, cfg.num_hidden_layers, "--layers") if cfg.is_sparse(i)
    ]
    if not layers:
        raise SystemExit("--layers selects no MoE layer of this checkpoint")
    experts = parse_ids(args.experts, cfg.num_experts, "--experts")
    hosted = {}
    start = time.perf_counter()
    for n, layer in enumerate(layers, 1):
        hosted.update(ckpt.read_experts({layer: experts}, dtype))
        print(
            f"loading experts: layer {layer} ({n}/{len(layers)}), {len(experts)} experts, "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
    # Live re-placement may ask for any expert of the checkpoint (moecomm rebalance).
    return (
        hosted,
        layers,
        experts,
        lambda layer, e: ckpt.read_experts({layer: [e]}, dtype)[layer][e],
    )


def build_server(args: argparse.Namespace, hosted, weight_source) -> ExpertServer:
    if is_cuda(args):
        from moecomm.runtime.device_server import DeviceExpertServer

        require_gpu("moecomm expert-server")
        hidden = next(iter(next(iter(hosted.values())).values())).hidden
        return DeviceExpertServer(
            hosted,
            device_layout(args, hidden),
            device=args.device,
            server_id=args.id or "expert-server",
            max_clients=args.max_clients,
            num_slots=args.num_slots,
            dtype=getattr(torch, args.dtype),
        )
    return ExpertServer(
        hosted,
        args.id or "expert-server",
        batching_window_s=args.batching_window_ms / 1e3,
        transport=args.transport,
        host=args.host,
        weight_source=weight_source,
    )


def warm_up(server: ExpertServer) -> None:
    """A server with device kernels (``--device cuda``) compiles and loads them all now, with a
    forward pass of every hosted layer: a cold Triton cache takes seconds, longer than a
    client's combine deadline, so the first request must not be the one that pays for it (the
    client would evict a healthy server)."""
    warm = getattr(server, "warm_up", None)
    if warm is None:
        return
    print(f"warm-up of {server.server_id}: compiling and loading the device kernels", flush=True)
    print(f"warm-up of {server.server_id}: warm in {warm():.1f} s", flush=True)


def start_serving(
    args: argparse.Namespace, server: ExpertServer, layers: list[int], experts: list[int]
) -> HttpServer:
    """Warm-up, the loop, the control plane, NVSHMEM and membership, in that order; then the
    'listening' line for people and the ready file (moecomm.readiness) launchers and tests wait
    for: a server that announced itself serves at full speed from its first request."""
    warm_up(server)
    server.start()
    http = HttpServer(make_app(server, args.token), args.host, args.port)
    url = http.start()
    try:
        if args.id is None:
            # Unique across hosts: two machines serve on the same port.
            server.server_id = f"expert-server-{url.split('://', 1)[1]}"
        if is_cuda(args):
            start_nvshmem(args, server, server.server_id)
        if args.monitor:
            server.join_membership(connect_membership(args.monitor, monitor_token()), url, args.ttl)
    except BaseException:
        http.stop()
        raise
    print(
        f"expert server {server.server_id} listening on {url}: layers {layers}, "
        f"experts {experts[0]}..{experts[-1]} ({len(experts)})",
        flush=True,
    )
    announce_ready(
        "expert-server", url=url, server_id=server.server_id, layers=layers, experts=experts
    )
    return http


def run(args: argparse.Namespace, ready: threading.Event | None = None) -> int:
    set_threads(args)
    hosted, layers, experts, weight_source = load_hosted(args)
    server = build_server(args, hosted, weight_source)
    stop, drain = threading.Event(), threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: drain.set())  # what orchestrators send first
    try:
        http = start_serving(args, server, layers, experts)
    except BaseException:
        server.close()
        raise
    if ready is not None:
        ready.set()
    try:
        while not stop.wait(WAKE_S):
            if drain.is_set():
                graceful_drain(server)
                break
            if not server.health.ok:
                # The loop failed: /health said so and the registration is withdrawn; exit
                # non-zero so that a supervisor restarts this process.
                print(
                    f"expert server {server.server_id}: unhealthy, exiting: {server.health.reason}",
                    file=sys.stderr,
                    flush=True,
                )
                break
    finally:
        print(f"expert server {server.server_id}: stopping", flush=True)
        http.stop()
        server.close()
    return 0 if server.health.ok else LOOP_FAILED_EXIT
