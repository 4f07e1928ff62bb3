"""The `moecomm` command: one entry point, one subcommand per service."""

from __future__ import annotations

import argparse
import os
import sys

from moecomm.membership import monitor
from moecomm.pipeline import agent as stage_agent

from moecomm_serving.cli import demo, expert_server, loadgen
from moecomm_serving.cli import frontend as frontend_cmd
from moecomm_serving.cli import rebalance as rebalance_cmd
from moecomm_serving.cli import router as router_cmd
from moecomm_serving.cli.device import add_device_arguments
from moecomm_serving.model import tiny

DESCRIPTION = """moecomm: serve Mixture-of-Experts models with the experts in separate services.

subcommands:
  monitor         the embedded membership monitor (heartbeats, joins, losses)
  expert-server   host experts of a checkpoint behind the slot protocol and an HTTP control plane
  frontend        the attention side: the model with its KV cache behind the OpenAI API
  router          the OpenAI API over prefill and decode front ends (frontend --role ...)
  stage-agent     run pipeline stages here for a front end on another host (--stage-hosts)
  rebalance       re-place experts on running expert servers from their measured load
  demo            monitor + two expert servers + a front end on the tiny model, a few prompts
  bench           a load generator against any OpenAI-compatible endpoint
  tiny            write the tiny random checkpoint used by the demo and the tests
"""


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stages",
        type=int,
        default=1,
        help="pipeline stages of the front end (2: the model split over two stage processes, "
        "each calling the expert servers)",
    )
    p.add_argument(
        "--pd",
        action="store_true",
        help="prefill and decode on separate front ends behind `moecomm router`",
    )
    tiny.add_arch_argument(p, help="model family of the tiny checkpoint")
    add_device_arguments(p, server=False)


# name: (short help, description, adds the options, runs the command)
COMMANDS = {
    "monitor": (
        "the embedded membership monitor",
        "Track members by heartbeat; push join/loss events to watchers over HTTP. "
        "Prints its URL on the first line.",
        monitor.add_arguments,
        monitor.run,
    ),
    "expert-server": (
        "host experts of a checkpoint",
        "Host the experts of some layers of a HF-layout checkpoint. Clients connect over HTTP "
        "and then exchange tokens through shared-memory slots. Runs until Ctrl-C.",
        expert_server.add_arguments,
        expert_server.run,
    ),
    "frontend": (
        "the model behind the OpenAI API",
        "Serve /v1/completions and /v1/chat/completions with continuous batching. Attention and "
        "the KV cache run here; the experts on expert servers (--servers or --monitor) or in "
        "this process (--local-experts).",
        frontend_cmd.add_arguments,
        frontend_cmd.run,
    ),
    "router": (
        "the OpenAI API over prefill and decode front ends",
        "Serve /v1/completions and /v1/chat/completions by running each request's prompt on a "
        "prefill front end and the rest on a decode front end (`moecomm frontend --role "
        "prefill|decode`), which receives the prompt's KV blocks over moecomm's transports. A "
        "front end that fails is replaced for the request (a lost decode front end: the "
        "request is replayed), then probed until it answers. Prints its URL once ready; runs "
        "until Ctrl-C.",
        router_cmd.add_arguments,
        router_cmd.run,
    ),
    "stage-agent": (
        "run pipeline stages for a front end on another host",
        "Listen for `moecomm frontend --stages N --stage-hosts ...` on another host and run the "
        "stages it places here, each as a process of its own. The token file is the right to "
        "run code on this host: keep it secret and listen on a private network.",
        stage_agent.add_arguments,
        stage_agent.run,
    ),
    "rebalance": (
        "re-place experts on running servers from their load",
        "Read the per-expert load of running expert servers, compute a placement that moves "
        "few replicas (EPLB, incremental) and apply it while they serve: new replicas are "
        "loaded first, then the old ones dropped once no client routes to them.",
        rebalance_cmd.add_arguments,
        rebalance_cmd.run,
    ),
    "demo": (
        "the whole system on the tiny model",
        "Start the monitor, two expert servers and a front end as processes on a tiny random "
        "checkpoint, send a few prompts, print completions and metrics, shut down.",
        _demo_arguments,
        demo.run,
    ),
    "bench": (
        "load generator for an OpenAI-compatible endpoint",
        "Send requests at a rate/concurrency and report throughput, TTFT, TPOT, ITL and "
        "end-to-end latency (mean, median, p99); --json writes the report.",
        loadgen.build_parser,
        loadgen.run_from_args,
    ),
    "tiny": (
        "write the tiny random checkpoint",
        "Write the tiny random MoE checkpoint (fixed seed).",
        tiny.add_arguments,
        tiny.run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moecomm",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (short, description, add_arguments, run) in COMMANDS.items():
        command = sub.add_parser(name, help=short, description=description)
        add_arguments(command)
        command.set_defaults(func=run)
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
