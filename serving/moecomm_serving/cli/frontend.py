"""`moecomm frontend`: the attention side — the model's attention and KV cache in this process,
its experts on expert servers (or in-process with --local-experts) — behind the OpenAI API."""

from __future__ import annotations

import argparse
import os

import torch
from moecomm.http_thread import DEFAULT_HOST
from moecomm.readiness import announce_ready
from moecomm.runtime.launch import SERVING_TTL_S
from moecomm.runtime.registry import ClientIdInUseError

from moecomm_serving.api.app import (
    CachedPrefixRoute,
    FrontendSettings,
    make_frontend_app,
    start_frontend,
)
from moecomm_serving.api.auth import check_exposure
from moecomm_serving.cli.common import (
    access_from_args,
    add_access_arguments,
    add_kv_cache_arguments,
    add_servers_arguments,
    add_threads_argument,
    add_token_argument,
    add_transport_argument,
    kv_cache_kwargs,
    set_threads,
    stop_on_signals,
    wait_for_stop,
)
from moecomm_serving.cli.device import add_device_arguments, is_cuda, require_gpu
from moecomm_serving.cli.frontend_stages import add_stage_host_arguments, run_pipelined
from moecomm_serving.cli.rebalance import (
    add_controller_arguments,
    check_placement_args,
    start_placement,
)
from moecomm_serving.disagg.routes import PdRoutes
from moecomm_serving.model.config import MoEConfig
from moecomm_serving.model.remote_experts import (
    DEFAULT_EXPERT_TIMEOUT_S,
    NoExpertServersError,
    connect_experts,
    remote_from_args,
)
from moecomm_serving.model.tokenizer import load_tokenizer
from moecomm_serving.model.transformer import LOCAL, load_model

# Tokens per engine step by default: decode batches of the demo and the tiny model fit easily.
DEFAULT_MAX_BATCH_TOKENS = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="HF-layout checkpoint directory")
    add_threads_argument(p)
    p.add_argument("--model-name", default=None, help="name served as `model` (default: dir name)")
    add_servers_arguments(
        p,
        monitor_help="find expert servers through this membership and follow joins and losses "
        "(http://... or etcd://...)",
        local_experts=True,
    )
    p.add_argument("--host", default=DEFAULT_HOST, help="HTTP address (loopback by default)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free one)")
    add_token_argument(p)
    add_transport_argument(p)
    p.add_argument(
        "--client-id",
        type=int,
        default=None,
        help="this front end's id at the expert servers (default: random; an id held by another "
        "live front end is refused)",
    )
    p.add_argument(
        "--encoding",
        default="f32",
        help="activation encoding on the wire: f32, bf16, int8, fp8_e4m3, ...",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        help="tokens per engine step (prefill chunks + decodes)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_EXPERT_TIMEOUT_S,
        help="per-request deadline of an expert round trip (s)",
    )
    p.add_argument("--ttl", type=float, default=SERVING_TTL_S, help="membership lease (s)")
    p.add_argument(
        "--stages",
        type=int,
        default=1,
        help="pipeline stages: N > 1 splits the model's layers over N stage processes, each "
        "calling the expert servers through its own client, with DynaPipe layer redistribution "
        "(default 1: the whole model in this process)",
    )
    p.add_argument(
        "--standby-stages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --stages N > 1: keep a second set of N stage processes started, so a lost "
        "stage is replaced without waiting for new ones to start (--no-standby-stages saves "
        "their memory; a replacement then starts new stages); see docs/pipeline.md",
    )
    p.add_argument(
        "--stage-micro-batches",
        type=int,
        default=None,
        help="with --stages N > 1: micro-batches (1..N) each engine step is cut into, all in "
        "flight at once so the stages compute at the same time (default 1: no overlap, faster "
        "where the stages share a few cores; see docs/pipeline.md)",
    )
    add_stage_host_arguments(p)
    p.add_argument(
        "--eplb-interval",
        type=float,
        default=0.0,
        help="re-place experts on the expert servers from their measured load every this many "
        "seconds, while serving (default 0: off); see `moecomm rebalance` for the settings",
    )
    add_controller_arguments(p, prefix="eplb-")
    add_kv_cache_arguments(p)
    p.add_argument(
        "--role",
        choices=["prefill", "decode", "both"],
        default=None,
        help="serve a side of the prefill/decode split behind `moecomm router` (docs/router.md): "
        "prefill runs prompts and hands their KV blocks to a decode front end over --transport "
        "(shm on one host, nixl across hosts); decode takes them and generates the rest; both "
        "does either (default: none, a plain front end; the OpenAI routes stay on in every "
        "role)",
    )
    add_access_arguments(p)
    add_device_arguments(p, server=False)


def connect_remote_experts(args: argparse.Namespace, config):
    """The experts backend of the expert servers the options name: an AttentionClient following
    the monitor on the host path, a DeviceClient (servers reachable at start; a lost one is
    evicted by the client's failover) with --device cuda."""
    try:
        return connect_experts(
            remote_from_args(args),
            config.hidden_size,
            config.num_experts_per_tok,
            args.max_batch_tokens,
            client_id=args.client_id,
            say=lambda line: print(line, flush=True),
        )
    except NoExpertServersError as exc:
        raise SystemExit(str(exc)) from None
    except ClientIdInUseError as exc:
        raise SystemExit(f"moecomm frontend: {exc}") from None


def run(args: argparse.Namespace) -> int:
    if args.stages < 1:
        raise SystemExit(f"moecomm frontend: --stages must be >= 1, got {args.stages}")
    if args.stages == 1 and (args.stage_hosts or args.stage_token_file):
        raise SystemExit("moecomm frontend: --stage-hosts and --stage-token-file need --stages > 1")
    if args.role is not None and (args.stages > 1 or is_cuda(args)):
        # the stages keep the caches (no block pool to export); the GPU path has none either
        raise SystemExit("moecomm frontend: --role works with --stages 1 on the CPU path only")
    if args.stages > 1 and args.prefix_cache_bytes:
        # The stages keep their own growable caches (docs/pipeline.md); a prefix cache there
        # would have to be shared by every stage's blocks.
        raise SystemExit("moecomm frontend: --prefix-cache-bytes works with --stages 1 only")
    check_placement_args(args)
    if is_cuda(args) and (args.eplb_interval > 0 or args.local_experts):
        raise SystemExit(
            "moecomm frontend --device cuda: --eplb-interval and --local-experts are not on the "
            "GPU path"
        )
    if is_cuda(args):
        require_gpu("moecomm frontend")
    # before anything starts: a bad secret file, or the split's routes open beyond loopback
    access = access_from_args(args, "frontend")
    check_exposure(args.role, args.host, access, "frontend")
    if args.stages > 1:
        return run_pipelined(args)
    set_threads(args)
    config = MoEConfig.from_file(args.checkpoint)
    # before connecting anywhere: a tokenizer that does not fit the model is refused at once
    tokenizer = load_tokenizer(args.checkpoint, config)
    client = None
    if args.local_experts:
        experts = LOCAL
    else:
        client = experts = connect_remote_experts(args, config)
    print(f"loading {args.checkpoint}", flush=True)
    model = load_model(args.checkpoint, experts=experts, dtype=torch.float32)
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    settings = FrontendSettings(name, args.max_batch_tokens, **kv_cache_kwargs(args, "frontend"))
    # with a role, the prefill/decode split's routes (and its KV inbox or outbox)
    # (and the router's question about this front end's prefix cache)
    split = (
        []
        if args.role is None
        else [PdRoutes(args.role, args.transport, args.host), CachedPrefixRoute()]
    )
    app = make_frontend_app(model, tokenizer, settings, split, access)
    stop = stop_on_signals()
    http = start_frontend(app, args.host, args.port)
    role = f" (role {args.role})" if args.role else ""
    print(f"frontend {name}{role} listening on {http.url}", flush=True)
    announce_ready("frontend", url=http.url, name=name, pd_role=args.role, stages=1)
    controller = None
    if client is not None:
        controller = start_placement(args, client.live_urls)
    elif args.eplb_interval > 0:
        raise SystemExit(
            "moecomm frontend: --eplb-interval needs expert servers, not --local-experts"
        )
    try:
        wait_for_stop(stop)
    finally:
        print("frontend: stopping", flush=True)
        if controller is not None:
            controller.stop()
        http.stop()  # before the client: in-flight steps still need their expert servers
        if client is not None:
            client.close()
    return 0
