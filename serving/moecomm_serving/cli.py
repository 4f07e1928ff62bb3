"""The `moecomm` command: one entry point, one subcommand per service."""

from __future__ import annotations

import argparse
import os
import sys

from moecomm.membership.base import TOKEN_ENV

from moecomm_serving import demo, expert_server, frontend_cmd, loadgen, rebalance_cmd

DESCRIPTION = """moecomm: serve Mixture-of-Experts models with the experts in separate services.

subcommands:
  monitor         the embedded membership monitor (heartbeats, joins, losses)
  expert-server   host experts of a checkpoint behind the slot protocol and an HTTP control plane
  frontend        the attention side: the model with its KV cache behind the OpenAI API
  rebalance       re-place experts on running expert servers from their measured load
  demo            monitor + two expert servers + a front end on the tiny model, a few prompts
  bench           a load generator against any OpenAI-compatible endpoint
  tiny            write the tiny random checkpoint used by the demo and the tests
"""


def _tiny(args: argparse.Namespace) -> int:
    from moecomm_serving.tiny import main as tiny_main

    tiny_main(["--out", args.out, "--arch", args.arch, "--seed", str(args.seed)])
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
        "--token-file", default=None, help=f"file with the shared token (or ${TOKEN_ENV})"
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
    fe = sub.add_parser(
        "frontend",
        help="the model behind the OpenAI API",
        description="Serve /v1/completions and /v1/chat/completions with continuous batching. "
        "Attention and the KV cache run here; the experts on expert servers (--servers or "
        "--monitor) or in this process (--local-experts).",
    )
    frontend_cmd.add_arguments(fe)
    fe.set_defaults(func=frontend_cmd.run)
    rb = sub.add_parser(
        "rebalance",
        help="re-place experts on running servers from their load",
        description="Read the per-expert load of running expert servers, compute a placement "
        "that moves few replicas (EPLB, incremental) and apply it while they serve: new "
        "replicas are loaded first, then the old ones dropped once no client routes to them.",
    )
    rebalance_cmd.add_arguments(rb)
    rb.set_defaults(func=rebalance_cmd.run)
    dm = sub.add_parser(
        "demo",
        help="the whole system on the tiny model",
        description="Start the monitor, two expert servers and a front end as processes on a "
        "tiny random checkpoint, send a few prompts, print completions and metrics, shut down.",
    )
    dm.add_argument(
        "--stages",
        type=int,
        default=1,
        help="pipeline stages of the front end (2: the model split over two stage processes, "
        "each calling the expert servers)",
    )
    dm.add_argument(
        "--arch",
        default="mixtral",
        choices=["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"],
        help="model family of the tiny checkpoint",
    )
    dm.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or cuda: expert servers on the GPU and a front end that reaches them "
        "over CUDA IPC (needs a CUDA device and moecomm built with CUDA; fails at once without)",
    )
    dm.set_defaults(func=demo.run)
    bn = sub.add_parser(
        "bench",
        help="load generator for an OpenAI-compatible endpoint",
        description="Send requests at a rate/concurrency and report throughput, TTFT, TPOT, "
        "ITL and end-to-end latency (mean, median, p99); --json writes the report.",
    )
    loadgen.build_parser(bn)
    bn.set_defaults(func=loadgen.run_from_args)
    tiny = sub.add_parser(
        "tiny",
        help="write the tiny random checkpoint",
        description="Write the tiny random MoE checkpoint (fixed seed).",
    )
    tiny.add_argument("--out", required=True)
    tiny.add_argument(
        "--arch",
        "--layout",
        dest="arch",
        default="mixtral",
        choices=["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"],
        help="model family (--layout is its older name)",
    )
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_tiny)
    return p


# Set to 1 to see the traceback of a checkpoint or file error instead of its one-line message.
TRACEBACK_ENV = "MOECOMM_TRACEBACK"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError) as exc:
        # A missing or malformed checkpoint (config, weights, tokenizer, chat template) or an
        # unwritable path: the message names the file, a traceback would only hide it.
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        print(f"moecomm {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
