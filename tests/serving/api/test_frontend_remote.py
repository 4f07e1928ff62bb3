"""The front end over expert servers: an AttentionClient as the experts backend serves what
the local model generates, /health goes through the servers, and /metrics reads the client's
failover count."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from frontend_helpers import MODEL_NAME
from moecomm.runtime import ExpertServer
from moecomm.runtime.control import HttpServer, make_app
from moecomm.testing import connect_client
from moecomm_serving.model.checkpoint import Checkpoint
from moecomm_serving.model.transformer import load_model

TIMEOUT_S = 60.0
# Per-dispatch rows of the client's slots; the engine's step budget must fit in it.
CLIENT_MAX_TOKENS = 64
HOSTED = ({i: range(0, 8) for i in range(4)}, {i: range(8, 16) for i in range(4)})
# The second prompt is longer than a step (CLIENT_MAX_TOKENS): its prefill is chunked.
PROMPTS = ("remote experts", "two servers, one client; " * 4)


@pytest.fixture(scope="module")
def remote_served(tiny_dir, model, serve):
    ckpt = Checkpoint(tiny_dir)
    running = []
    client = None
    try:
        for k, hosted in enumerate(HOSTED):
            server = ExpertServer(ckpt.read_experts(hosted), f"fe{k}")
            http = HttpServer(make_app(server))
            server.start()
            running.append((server, http, http.start()))
        cfg = model.config
        client = connect_client(
            [url for _, _, url in running],
            cfg.hidden_size,
            cfg.num_experts_per_tok,
            CLIENT_MAX_TOKENS,
            client_id=7,
            timeout=20.0,
        )
        remote = load_model(tiny_dir, experts=client, dtype=torch.float32)
        served = serve(remote, max_batch_tokens=CLIENT_MAX_TOKENS)
        yield served, client
        served.stop()  # before the client closes: the engine must not dispatch any more
    finally:
        if client is not None:
            client.close()
        for server, http, _ in running:
            http.stop()
            server.close()


def test_remote_experts_serve_what_the_local_model_generates(remote_served, tok, solo):
    served, _ = remote_served

    async def both():
        async with httpx.AsyncClient() as c:
            jobs = []
            for p in PROMPTS:
                body = {"model": MODEL_NAME, "prompt": p, "max_tokens": 6, "temperature": 0.0}
                body.update(ignore_eos=True, return_token_ids=True)
                jobs.append(c.post(f"{served.url}/v1/completions", json=body, timeout=TIMEOUT_S))
            return await asyncio.gather(*jobs)

    assert len(tok.encode(PROMPTS[1])) > CLIENT_MAX_TOKENS
    for p, r in zip(PROMPTS, asyncio.run(both()), strict=True):
        assert r.status_code == 200, r.text
        want = solo(tok.encode(p), max_new_tokens=6, ignore_eos=True)
        assert r.json()["choices"][0]["token_ids"] == want


def test_remote_health_and_failover_metric(remote_served):
    served, client = remote_served
    assert httpx.get(f"{served.url}/health", timeout=TIMEOUT_S).status_code == 200
    text = httpx.get(f"{served.url}/metrics", timeout=TIMEOUT_S).text
    assert f"moecomm_failovers_total {client.failovers}\n" in text
    client.failovers += 2  # the gauge is read live from the client at each scrape
    text = httpx.get(f"{served.url}/metrics", timeout=TIMEOUT_S).text
    assert f"moecomm_failovers_total {client.failovers}\n" in text
