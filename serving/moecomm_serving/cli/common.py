"""What several `moecomm` subcommands share, defined once: their common option groups and the
foreground wait of a long-running service.

A command that takes one of these options adds it with the function here, so the option has
one name, default and help everywhere (`moecomm expert-server`, `frontend`, `rebalance`); the
GPU path's options are in :mod:`moecomm_serving.cli.device`, the tiny checkpoint's in
:mod:`moecomm_serving.model.tiny`, the monitor's in :mod:`moecomm.membership.monitor`.
"""

from __future__ import annotations

import argparse
import signal
import threading

from moecomm.wire.choose import TRANSPORT_CHOICES

__all__ = [
    "DEFAULT_MIN_REPLICAS",
    "WAKE_S",
    "access_from_args",
    "add_access_arguments",
    "add_kv_cache_arguments",
    "add_min_replicas_argument",
    "add_servers_arguments",
    "add_threads_argument",
    "add_token_argument",
    "add_transport_argument",
    "kv_cache_kwargs",
    "set_threads",
    "stop_on_signals",
    "wait_for_stop",
]

# How often the foreground thread of a service checks for a stop request: the latency of Ctrl-C.
WAKE_S = 0.2
# What the clients of the expert servers (front end, rebalance) say about --token.
CLIENT_TOKEN_HELP = "token of the expert servers' control planes"
# Copies of every expert that re-placement keeps on distinct expert servers: with 2, losing any
# one server leaves every expert served while its copies are re-homed. Fewer when
# fewer servers host a layer (the pass says so).
DEFAULT_MIN_REPLICAS = 2


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """--threads, read by :func:`set_threads`."""
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of this process (default: torch's choice); give each process of "
        "a host its share of the cores — oversubscribed thread pools spin against each other",
    )


def set_threads(args: argparse.Namespace) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {args.threads}")
        import torch  # here, not at the top: the router shares this module and loads no torch

        torch.set_num_threads(args.threads)


def add_transport_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transport",
        default="auto",
        choices=list(TRANSPORT_CHOICES),
        help="data path to the other side: shm (one host), nixl (NIXL over UCX, across hosts; "
        "pip install 'moecomm[nixl]') or auto (shm with peers that share this host's /dev/shm, "
        "nixl with the others; shm only when NIXL is not installed)",
    )


def add_kv_cache_arguments(p: argparse.ArgumentParser) -> None:
    """--kv-block-tokens and --prefix-cache-bytes, read by :func:`kv_cache_kwargs`."""
    # here, not at the top: the block pool module imports torch, the router this module
    from moecomm_serving.kv.blocks import DEFAULT_BLOCK_TOKENS

    p.add_argument(
        "--kv-block-tokens",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        help="tokens per block of the paged KV cache (default %(default)s; 0: one growable "
        "buffer per request and layer, the old cache)",
    )
    p.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=0,
        help="byte budget of the prefix cache: KV blocks of earlier prompts kept (least "
        "recently used evicted) so a request that starts the same way skips that prefill "
        "(default 0: off; needs the paged cache)",
    )


def kv_cache_kwargs(args: argparse.Namespace, command: str) -> dict:
    """The engine's KV cache settings from :func:`add_kv_cache_arguments`'s options."""
    if args.kv_block_tokens < 0 or args.prefix_cache_bytes < 0:
        raise SystemExit(
            f"moecomm {command}: --kv-block-tokens and --prefix-cache-bytes must be >= 0"
        )
    if args.prefix_cache_bytes and not args.kv_block_tokens:
        raise SystemExit(f"moecomm {command}: --prefix-cache-bytes needs --kv-block-tokens > 0")
    return {
        "kv_block_tokens": args.kv_block_tokens or None,
        "prefix_cache_bytes": args.prefix_cache_bytes,
    }


def add_min_replicas_argument(p: argparse.ArgumentParser) -> None:
    """--min-replicas, read by :func:`check_min_replicas` and the placement controller."""
    p.add_argument(
        "--min-replicas",
        type=int,
        default=DEFAULT_MIN_REPLICAS,
        help="copies of every expert that re-placement keeps on distinct expert servers, and "
        "restores at once when a server is lost (default %(default)s; as many as there are "
        "servers when fewer, said in the pass's report; 1: EPLB's placement, cold experts on "
        "one server)",
    )


def check_min_replicas(args: argparse.Namespace, command: str) -> None:
    if args.min_replicas < 1:
        raise SystemExit(f"moecomm {command}: --min-replicas must be >= 1, got {args.min_replicas}")


def add_token_argument(p: argparse.ArgumentParser, help: str = CLIENT_TOKEN_HELP) -> None:
    """--token: the shared secret of the expert servers' control planes ("" : none)."""
    p.add_argument("--token", default="", help=help)


def add_access_arguments(p: argparse.ArgumentParser) -> None:
    """--api-key and --pd-secret-file, in a group of their own; read by
    :func:`access_from_args` (docs/frontend.md, "Access")."""
    from moecomm_serving.api.auth import API_KEY_ENV, PD_SECRET_ENV

    g = p.add_argument_group(
        "access", "who may call this server (Authorization: Bearer; /health and /metrics stay open)"
    )
    g.add_argument(
        "--api-key",
        default=None,
        help=f"key the OpenAI routes require, as vLLM's and SGLang's (or ${API_KEY_ENV}; "
        "default: none, open)",
    )
    g.add_argument(
        "--pd-secret-file",
        default=None,
        help="file holding the deployment's shared secret, which the prefill/decode routes "
        f"(/pd/...) require and the router sends (or ${PD_SECRET_ENV}; not argv: it moves KV "
        "and starts decodes)",
    )


def access_from_args(args: argparse.Namespace, command: str):
    """The :class:`~moecomm_serving.api.auth.Access` the options give (flag, then file, then
    environment); SystemExit naming the problem (an unreadable or empty secret file)."""
    from moecomm.auth import SecretError, SharedSecret

    from moecomm_serving.api.auth import API_KEY_ENV, PD_SECRET_ENV, Access

    try:
        key = SharedSecret.resolve(args.api_key, env=API_KEY_ENV, what="--api-key")
        secret = SharedSecret.resolve(
            file=args.pd_secret_file, env=PD_SECRET_ENV, what="--pd-secret-file"
        )
    except SecretError as exc:
        raise SystemExit(f"moecomm {command}: {exc}") from None
    return Access(api_key=key, deployment=secret)


def add_servers_arguments(
    p: argparse.ArgumentParser, monitor_help: str, local_experts: bool = False
) -> None:
    """Where the expert servers are, exactly one of: --servers URL,URL,... or --monitor (a
    membership to find them through); with `local_experts`, or --local-experts (none: the
    experts run in this process). Read by
    :func:`moecomm_serving.model.remote_experts.remote_from_args` and
    :func:`moecomm_serving.cli.rebalance.server_list`."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--servers", help="expert server control URLs, comma-separated")
    where.add_argument("--monitor", help=monitor_help)
    if local_experts:
        where.add_argument(
            "--local-experts",
            action="store_true",
            help="run the experts in this process (the monolithic baseline)",
        )


def stop_on_signals(*signals: signal.Signals) -> threading.Event:
    """An event set by any of `signals` (default SIGINT and SIGTERM), for :func:`wait_for_stop`."""
    stop = threading.Event()
    for sig in signals or (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_stop(stop: threading.Event) -> None:
    """Blocks the foreground thread until `stop` is set; waking every WAKE_S keeps the signal
    handlers running (a thread blocked in one long wait would not see Ctrl-C promptly)."""
    while not stop.wait(WAKE_S):
        pass
