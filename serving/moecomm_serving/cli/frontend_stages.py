"""`moecomm frontend --stages N` (N > 1): the model split into N pipeline stage processes, each
calling the expert servers through its own attention client (or running its experts in-process
with --local-experts), behind the same OpenAI API as the single-process front end."""

from __future__ import annotations

import argparse
import functools
import itertools
import os

import torch
from moecomm.pipeline.remote import parse_address, read_token
from moecomm.readiness import announce_ready

from moecomm_serving.api.app import FrontendSettings, make_frontend_app, start_frontend
from moecomm_serving.cli.common import access_from_args, set_threads, stop_on_signals, wait_for_stop
from moecomm_serving.cli.rebalance import server_list, start_placement
from moecomm_serving.engine.pipeline import PipelinedModel
from moecomm_serving.engine.stages import model_pipeline
from moecomm_serving.model.config import MoEConfig
from moecomm_serving.model.remote_experts import remote_from_args
from moecomm_serving.model.tokenizer import load_tokenizer


def add_stage_host_arguments(p: argparse.ArgumentParser) -> None:
    """`moecomm frontend`'s options that place pipeline stages on other hosts."""
    p.add_argument(
        "--stage-hosts",
        default=None,
        help="with --stages N > 1: where each stage runs, N comma-separated entries, each "
        "'local' (a process here) or HOST:PORT of a stage agent on another host (`python -m "
        "moecomm.pipeline.agent --host HOST --port PORT --token-file F` there; the checkpoint "
        "must be at the same path). Stages on one host talk over shm, across hosts over nixl "
        "(default: every stage here)",
    )
    p.add_argument(
        "--stage-token-file",
        default=None,
        help="with --stage-hosts: file holding the token the stage agents check (the same file "
        "content as theirs)",
    )


def stage_placement(args: argparse.Namespace) -> tuple[list[str | None] | None, bytes]:
    """(stage_hosts, token) from --stage-hosts / --stage-token-file, with clear errors."""
    spec = getattr(args, "stage_hosts", None)
    if not spec:
        return None, b""
    places = [p.strip() for p in spec.split(",")]
    if len(places) != args.stages:
        raise SystemExit(
            f"moecomm frontend: --stage-hosts names {len(places)} places for {args.stages} "
            "stages (one per stage, 'local' for this host)"
        )
    for place in places:
        if place != "local":
            try:
                parse_address(place)
            except ValueError as exc:
                raise SystemExit(f"moecomm frontend: --stage-hosts: {exc}") from None
    if all(p == "local" for p in places):
        return None, b""
    host = getattr(args, "host", None) or ""
    if host == "localhost" or host.startswith("127.") or host == "::1":
        raise SystemExit(
            "moecomm frontend: --stage-hosts with stages on other hosts needs --host set to this "
            f"host's address on their network (got {host}): the local stages carry nixl over it"
        )
    token_file = getattr(args, "stage_token_file", None)
    if not token_file:
        raise SystemExit(
            "moecomm frontend: --stage-hosts with remote stages needs --stage-token-file"
        )
    return [None if p == "local" else p for p in places], read_token(token_file)


def run_pipelined(args: argparse.Namespace) -> int:
    if args.eplb_interval > 0 and args.local_experts:
        raise SystemExit(
            "moecomm frontend: --eplb-interval needs expert servers, not --local-experts"
        )
    set_threads(args)
    config = MoEConfig.from_file(args.checkpoint)
    if config.num_hidden_layers < args.stages:
        raise SystemExit(
            f"moecomm frontend: {args.stages} stages need at least as many layers, the model "
            f"has {config.num_hidden_layers}"
        )
    micro = 1 if args.stage_micro_batches is None else args.stage_micro_batches
    if not 1 <= micro <= args.stages:  # one slot per stage boundary and micro-batch in flight
        raise SystemExit(
            f"moecomm frontend: --stage-micro-batches must be in [1, {args.stages}], got {micro}"
        )
    stage_hosts, stage_token = stage_placement(args)
    remote = None if args.local_experts else remote_from_args(args)
    where = "in-process experts" if remote is None else "expert servers"
    print(f"starting {args.stages} pipeline stages over {where}", flush=True)
    build = functools.partial(
        model_pipeline,
        args.checkpoint,
        args.stages,
        dtype=torch.float32,
        max_tokens=args.max_batch_tokens,
        remote=remote,
        return_logits=True,
        stage_hosts=stage_hosts,
        host=None if args.host in (None, "", "0.0.0.0") else args.host,
        stage_token=stage_token,
    )
    banks = itertools.count()

    def start(initial_k: int = 0):
        # A given client id names the first stage's client (the others follow it). The serving
        # pipeline and its standby are up at once, so they take turns between two banks of ids:
        # a pipeline is only started once the one that held its bank is closed.
        bank = next(banks) % 2
        cid = None if args.client_id is None else args.client_id + bank * args.stages
        return build(client_id=cid, initial_k=initial_k)

    pipe = start()
    say = functools.partial(print, flush=True)
    model = PipelinedModel(
        pipe, config, restart=start, standby=args.standby_stages, say=say, micro_batches=micro
    )
    http = controller = None
    try:
        tokenizer = load_tokenizer(args.checkpoint, config)
        name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
        settings = FrontendSettings(name, args.max_batch_tokens)
        access = access_from_args(args, "frontend")  # the API key (no role with stages)
        app = make_frontend_app(model, tokenizer, settings, access=access)
        stop = stop_on_signals()
        http = start_frontend(app, args.host, args.port)
        ranges = " | ".join(f"{r.start}-{r.stop - 1}" for r in pipe.ranges)
        print(f"pipeline stages ready: layers {ranges}", flush=True)
        print(f"pipeline stage pids: {' '.join(map(str, pipe.pids))}", flush=True)
        # The last line of the start-up, in the single-process front end's format.
        print(f"frontend {name} listening on {http.url}", flush=True)
        announce_ready(
            "frontend",
            url=http.url,
            name=name,
            pd_role=None,
            stages=len(pipe.ranges),
            stage_pids=list(pipe.pids),
        )
        # The stages' clients share the servers: the controller reads them from the flags.
        # In-process experts have no servers to place on (--eplb-interval is refused above).
        if not args.local_experts:
            controller = start_placement(args, server_list(args))
        wait_for_stop(stop)
    finally:
        print("frontend: stopping", flush=True)
        if controller is not None:
            controller.stop()
        if http is not None:
            http.stop()  # before the stages: in-flight steps still need them
        model.close()
    return 0
