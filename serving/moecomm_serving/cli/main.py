"""The `moecomm` command: one entry point, one subcommand per service.

A subcommand's module is imported only when that subcommand is parsed (or its help shown):
the router process never loads torch or model code, and every command starts without
importing the others.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

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


# name: (short help, description, module, its function that adds the options, its function
# that runs the command)
COMMANDS = {
    "monitor": (
        "the embedded membership monitor",
        "Track members by heartbeat; push join/loss events to watchers over HTTP. "
        "Prints its URL on the first line.",
        "moecomm.membership.monitor",
        "add_arguments",
        "run",
    ),
    "expert-server": (
        "host experts of a checkpoint",
        "Host the experts of some layers of a HF-layout checkpoint. Clients connect over HTTP "
        "and then exchange tokens through shared-memory slots. Runs until Ctrl-C.",
        "moecomm_serving.cli.expert_server",
        "add_arguments",
        "run",
    ),
    "frontend": (
        "the model behind the OpenAI API",
        "Serve /v1/completions and /v1/chat/completions with continuous batching. Attention and "
        "the KV cache run here; the experts on expert servers (--servers or --monitor) or in "
        "this process (--local-experts).",
        "moecomm_serving.cli.frontend",
        "add_arguments",
        "run",
    ),
    "router": (
        "the OpenAI API over prefill and decode front ends",
        "Serve /v1/completions and /v1/chat/completions by running each request's prompt on a "
        "prefill front end and the rest on a decode front end (`moecomm frontend --role "
        "prefill|decode`), which receives the prompt's KV blocks over moecomm's transports. A "
        "front end that fails is replaced for the request (a lost decode front end: the "
        "request is replayed), then probed until it answers. Prints its URL once ready; runs "
        "until Ctrl-C.",
        "moecomm_serving.cli.router",
        "add_arguments",
        "run",
    ),
    "stage-agent": (
        "run pipeline stages for a front end on another host",
        "Listen for `moecomm frontend --stages N --stage-hosts ...` on another host and run the "
        "stages it places here, each as a process of its own. The token file is the right to "
        "run code on this host: keep it secret and listen on a private network.",
        "moecomm.pipeline.agent",
        "add_arguments",
        "run",
    ),
    "rebalance": (
        "re-place experts on running servers from their load",
        "Read the per-expert load of running expert servers, compute a placement that moves "
        "few replicas (EPLB, incremental) and apply it while they serve: new replicas are "
        "loaded first, then the old ones dropped once no client routes to them.",
        "moecomm_serving.cli.rebalance",
        "add_arguments",
        "run",
    ),
    "demo": (
        "the whole system on the tiny model",
        "Start the monitor, two expert servers and a front end as processes on a tiny random "
        "checkpoint, send a few prompts, print completions and metrics, shut down.",
        "moecomm_serving.cli.demo",
        "add_arguments",
        "run",
    ),
    "bench": (
        "load generator for an OpenAI-compatible endpoint",
        "Send requests at a rate/concurrency and report throughput, TTFT, TPOT, ITL and "
        "end-to-end latency (mean, median, p99); --json writes the report.",
        "moecomm_serving.cli.loadgen",
        "build_parser",
        "run_from_args",
    ),
    "tiny": (
        "write the tiny random checkpoint",
        "Write the tiny random MoE checkpoint (fixed seed).",
        "moecomm_serving.model.tiny",
        "add_arguments",
        "run",
    ),
}


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser whose options are added on first use: :meth:`load` imports the
    command's module, adds its options and sets ``func`` to its run function, before the
    command's arguments are parsed or its help or usage is written."""

    command: tuple[str, str, str] | None = None  # (module, add-options function, run function)

    def load(self) -> None:
        if self.command is None:
            return
        module_name, add_name, run_name = self.command
        self.command = None
        module = importlib.import_module(module_name)
        getattr(module, add_name)(self)
        self.set_defaults(func=getattr(module, run_name))

    def parse_known_args(self, args=None, namespace=None):
        self.load()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.load()
        return super().format_usage()

    def format_help(self) -> str:
        self.load()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    """The `moecomm` parser; no subcommand's module is imported until it is parsed."""
    p = argparse.ArgumentParser(
        prog="moecomm",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    for name, (short, description, module, add_arguments, run) in COMMANDS.items():
        command = sub.add_parser(name, help=short, description=description)
        command.command = (module, add_arguments, run)
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
