"""Greedy generation through expert-server processes equals in-process generation token for
token — also when a server is killed with SIGKILL in the middle while a replica exists."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest
import torch
from moecomm import prefork
from moecomm.runtime.control import HttpServer, make_app
from moecomm.runtime.server import ExpertServer
from moecomm.testing import connect_client
from moecomm_serving.engine.generate import Generation, generate, step
from moecomm_serving.model.checkpoint import Checkpoint
from moecomm_serving.model.tokenizer import ByteTokenizer
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams

NEW_TOKENS = 12
KILL_AFTER_STEP = 4
START_S = 120.0


def _serve(conn, ckpt_dir, hosted):
    torch.set_num_threads(1)
    server = ExpertServer(Checkpoint(ckpt_dir).read_experts(hosted), f"p{os.getpid()}")
    http = HttpServer(make_app(server))
    server.start()
    conn.send(http.start())
    with contextlib.suppress(EOFError):
        conn.recv()
    http.stop()
    server.close()


@pytest.fixture
def server_procs(mixtral_dir):
    """Two expert-server processes, each hosting every expert of every layer (replicas)."""
    ctx = prefork.process_context()
    procs = []
    try:
        for _ in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_serve,
                args=(child, mixtral_dir, {i: range(16) for i in range(4)}),
                daemon=True,
            )
            p.start()
            assert parent.poll(START_S), "expert server did not start"
            procs.append((p, parent, parent.recv()))
        yield procs
    finally:
        for p, conn, _ in procs:
            if p.is_alive():
                with contextlib.suppress(OSError):
                    conn.send("stop")
                p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)


@pytest.mark.timeout(300)
def test_greedy_tokens_survive_a_kill_9_mid_generation(server_procs, mixtral_dir, mixtral):
    cfg = mixtral.config
    client = connect_client(
        [url for _, _, url in server_procs],
        cfg.hidden_size,
        cfg.num_experts_per_tok,
        64,
        client_id=3,
        timeout=2.0,
    )
    try:
        remote = load_model(mixtral_dir, experts=client)
        tok = ByteTokenizer()
        prompts = [tok.encode("kill a server"), tok.encode("and keep generating")]
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        want = [g.tokens for g in generate(mixtral, prompts, params)]
        gens = [Generation(remote, p, params) for p in prompts]
        for i in range(NEW_TOKENS):
            if i == KILL_AFTER_STEP:
                victim = server_procs[1][0]
                os.kill(victim.pid, signal.SIGKILL)
                victim.join(10)
            step(remote, gens)
        assert [g.tokens for g in gens] == want
        assert client.failovers >= 1  # the kill hit requests in flight or routed to it
    finally:
        client.close()
