"""`moecomm rebalance`: re-place experts on running expert servers from their measured load
(once, or every --interval seconds), and `--eplb-interval` of `moecomm frontend`."""

from __future__ import annotations

import argparse
import json

from moecomm.membership import connect_membership, monitor_token
from moecomm.runtime.placement import (
    MIN_WINDOW_TOKENS,
    WEIGHT_SOURCES,
    PlacementController,
    RebalanceReport,
)

from moecomm_serving.cli.common import (
    add_min_replicas_argument,
    add_servers_arguments,
    add_token_argument,
    check_min_replicas,
    stop_on_signals,
    wait_for_stop,
)
from moecomm_serving.model.remote_experts import server_urls

# A layer is re-placed only if its heaviest server drops by this fraction (5%): smaller gains
# are within the noise of a few seconds of load and not worth moving weights for.
DEFAULT_MIN_GAIN = 0.05


def add_controller_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The placement settings shared by `moecomm rebalance` and `moecomm frontend`."""
    p.add_argument(
        f"--{prefix}weights-from",
        # The checkpoint restores faster than a peer's pull (docs/placement.md, quiet run).
        default="checkpoint",
        choices=WEIGHT_SOURCES,
        help="where a server gets the weights of an expert it is given: read from its "
        "checkpoint, or pulled from a server that hosts it (over the transport); the other is "
        "the fallback",
    )
    p.add_argument(
        f"--{prefix}min-gain",
        type=float,
        default=DEFAULT_MIN_GAIN,
        help="re-place a layer only if its heaviest server's load drops by this fraction",
    )
    p.add_argument(
        f"--{prefix}min-tokens",
        type=int,
        default=MIN_WINDOW_TOKENS,
        help="tokens the load window must hold before anything moves (restoring the copies of "
        "--min-replicas does not wait for load)",
    )
    add_min_replicas_argument(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_servers_arguments(
        p, monitor_help="the membership the servers registered with (http://... or etcd://...)"
    )
    add_token_argument(p)
    p.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="re-place every this many seconds until Ctrl-C (default: once, now). One pass "
        "reads the load since the previous pass: the first pass of a fresh controller sees the "
        "servers' whole history",
    )
    add_controller_arguments(p)
    p.add_argument("--json", action="store_true", help="print each pass as one JSON line")


def server_list(args: argparse.Namespace):
    """A callable giving the live servers' URLs (re-read from the membership every pass)."""
    if args.servers:
        urls = [u.strip() for u in args.servers.split(",") if u.strip()]
        return lambda: urls
    membership = connect_membership(args.monitor, monitor_token())
    return lambda: server_urls(membership)


def summary(r: RebalanceReport) -> str:
    if r.skipped:
        return f"rebalance: nothing moved ({r.skipped})"
    what = f"restored {r.min_replicas_held} copies, " if r.trigger == "restore" else ""
    text = (
        f"rebalance: {what}{len(r.moves)} moves over {r.servers} servers: {r.replicas_loaded} "
        f"loaded ({r.bytes_moved / 1e6:.2f} MB, {r.sources}), {r.replicas_dropped} dropped; "
        f"imbalance {r.imbalance_before:.3f} -> {r.imbalance_after:.3f}; "
        f"converged in {r.converge_seconds:.2f} s"
    )
    text += f"; {r.redundancy_note}" if r.redundancy_note else ""
    return text + (f"; errors: {'; '.join(r.errors)}" if r.errors else "")


def check_placement_args(args: argparse.Namespace) -> None:
    check_min_replicas(args, "frontend")
    if args.eplb_interval > 0 and args.local_experts:
        raise SystemExit(
            "moecomm frontend: --eplb-interval needs expert servers (--servers or "
            "--monitor), not --local-experts"
        )


def start_placement(args: argparse.Namespace, servers) -> PlacementController | None:
    """`moecomm frontend --eplb-interval`: a placement controller over `servers()` (the front
    end's live servers, or those its flags name) in a background thread; None when off."""
    if args.eplb_interval <= 0:
        return None
    controller = PlacementController(
        servers,
        args.token,
        weights_from=args.eplb_weights_from,
        min_gain=args.eplb_min_gain,
        min_tokens=args.eplb_min_tokens,
        min_replicas=args.min_replicas,
        on_report=lambda r: r.skipped or print(f"frontend: {summary(r)}", flush=True),
    )
    controller.start(args.eplb_interval)
    print(f"frontend: re-placing experts every {args.eplb_interval:g} s", flush=True)
    return controller


def run(args: argparse.Namespace) -> int:
    check_min_replicas(args, "rebalance")
    controller = PlacementController(
        server_list(args),
        args.token,
        weights_from=args.weights_from,
        min_gain=args.min_gain,
        min_tokens=args.min_tokens,
        min_replicas=args.min_replicas,
    )

    def report(r: RebalanceReport) -> None:
        print(json.dumps(r.to_dict()) if args.json else summary(r), flush=True)

    if args.interval <= 0:
        r = controller.rebalance()
        report(r)
        return 1 if r.errors else 0
    stop = stop_on_signals()
    # A pass every --interval seconds (a failed one is logged; the next tries again) and, in
    # between, the watch that restores the copies of a lost server at once.
    controller.on_report = report
    controller.start(args.interval)
    try:
        wait_for_stop(stop)
    finally:
        controller.stop()
    return 0
