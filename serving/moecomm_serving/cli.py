"""The `moecomm` command: one entry point, one subcommand per service."""

from __future__ import annotations

import argparse
import sys

from moecomm_serving import expert_server

DESCRIPTION = """moecomm: serve Mixture-of-Experts models with the experts in separate services.

subcommands:
  monitor         the embedded membership monitor (heartbeats, joins, losses)
  expert-server   host experts of a checkpoint behind the slot protocol and an HTTP control plane
  tiny            write the tiny random checkpoint used by the demo and the tests
"""


def _tiny(args: argparse.Namespace) -> int:
    from moecomm_serving.tiny import main as tiny_main

    tiny_main(["--out", args.out, "--layout", args.layout, "--seed", str(args.seed)])
    return 0


def _monitor(args: argparse.Namespace) -> int:
    from moecomm.membership.monitor import main as monitor_main

    argv = ["--host", args.host, "--port", str(args.port)]
    if args.token_file:
        argv += ["--token-file", args.token_file]
    return monitor_main(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moecomm",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    mon = sub.add_parser(
        "monitor",
        help="the embedded membership monitor",
        description="Track members by heartbeat; push join/loss events to watchers over HTTP. "
        "Prints its URL on the first line.",
    )
    mon.add_argument("--host", default="127.0.0.1", help="address to bind (loopback)")
    mon.add_argument("--port", type=int, default=0, help="port (0: any free one)")
    mon.add_argument(
        "--token-file", default=None, help="file with the shared token (or $MOECOMM_MONITOR_TOKEN)"
    )
    mon.set_defaults(func=_monitor)
    es = sub.add_parser(
        "expert-server",
        help="host experts of a checkpoint",
        description="Host the experts of some layers of a HF-layout checkpoint. "
        "Clients connect over HTTP and then exchange tokens through "
        "shared-memory slots. Runs until Ctrl-C.",
    )
    expert_server.add_arguments(es)
    es.set_defaults(func=expert_server.run)
    tiny = sub.add_parser(
        "tiny",
        help="write the tiny random checkpoint",
        description="Write the tiny random MoE checkpoint (fixed seed).",
    )
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--layout", default="mixtral", choices=["mixtral", "qwen2_moe"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_tiny)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
