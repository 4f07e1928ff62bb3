"""`moecomm frontend --stages 2 --servers ...` as a real process over two real expert servers:
the OpenAI API serves what the in-process model generates (greedy and seeded sampling, prompts
batched together, a prompt longer than a step chunked), with the model split over two
pipeline stage processes that each call the expert servers."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import pytest
from frontend_helpers import MODEL_NAME
from moecomm.testing import CLI_ARGV, FrontendSpec, start_local_cluster

CLI = list(CLI_ARGV)
# A refused start imports torch first, on a loaded machine.
START_S = 120.0
TIMEOUT_S = 60.0
# The demo's split: experts 4-11 on both servers.
HOSTED = ("0-11", "4-15")
# Tokens per engine step (and per micro-batch slot): the second prompt needs two steps.
STEP_TOKENS = 32
PROMPTS = ("pipeline stages", "two stages, two servers, one front end; " * 2)
MAX_NEW = 8


@pytest.fixture(scope="module")
def pipelined_frontend(tiny_dir):
    args = ("--stages", "2", "--max-batch-tokens", str(STEP_TOKENS))
    cluster = start_local_cluster(
        tiny_dir,
        servers=HOSTED,
        frontends=[FrontendSpec(args=args)],
        model_name=MODEL_NAME,
        id_prefix="fe-pipe",
    )
    try:
        yield cluster.frontend_urls[0]
    finally:
        codes = cluster.close()  # the front end first: its stages still use the servers
    assert codes["frontend-0"] == 0


@pytest.mark.timeout(240)
def test_two_stages_over_expert_servers_serve_what_the_model_generates(
    pipelined_frontend, tok, solo
):
    url = pipelined_frontend
    assert httpx.get(f"{url}/health", timeout=TIMEOUT_S).json()["status"] == "ok"
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 5}

    async def all_at_once():
        async with httpx.AsyncClient() as c:
            jobs = []
            for p in PROMPTS:
                for params in ({"temperature": 0.0}, sampled):
                    body = {"model": MODEL_NAME, "prompt": p, "max_tokens": MAX_NEW, **params}
                    body.update(ignore_eos=True, return_token_ids=True)
                    jobs.append(c.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S))
            return await asyncio.gather(*jobs)

    assert len(tok.encode(PROMPTS[1])) > STEP_TOKENS  # its prefill is chunked
    answers = iter(asyncio.run(all_at_once()))
    for p in PROMPTS:
        for params in ({"temperature": 0.0}, sampled):
            r = next(answers)
            assert r.status_code == 200, r.text
            want = solo(tok.encode(p), max_new_tokens=MAX_NEW, ignore_eos=True, **params)
            assert r.json()["choices"][0]["token_ids"] == want, params


def test_stages_must_be_positive(tiny_dir):
    out = subprocess.run(
        [*CLI, "frontend", "--checkpoint", str(tiny_dir), "--local-experts", "--stages", "0"],
        capture_output=True,
        text=True,
        timeout=START_S,
    )
    assert out.returncode != 0 and "--stages must be >= 1" in out.stderr
