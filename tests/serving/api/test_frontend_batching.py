"""Continuous batching over HTTP: concurrent requests share engine steps, a new request's
prefill is packed with running decodes, and each result equals the request run alone."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from frontend_helpers import MODEL_NAME

TIMEOUT_S = 60.0
PROMPTS = ["Alpha", "A longer second prompt", "3", "Four experts, one server"]
# The first step waits for the whole burst: it starts as soon as this many requests are queued
# (max_num_seqs), and the window only bounds the wait if one request were lost.
BURST_WINDOW_S = 10.0


async def _complete(client, url, prompt, **kw):
    body = {"model": MODEL_NAME, "prompt": prompt, "temperature": 0.0, "return_token_ids": True}
    r = await client.post(f"{url}/v1/completions", json={**body, **kw}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_concurrent_requests_share_steps_and_equal_solo(serve, model, tok, solo):
    served = serve(model, max_num_seqs=len(PROMPTS), batch_wait_s=BURST_WINDOW_S)
    lengths = [9, 14, 5, 11]  # different lengths: requests leave the batch at different steps

    async def burst():
        async with httpx.AsyncClient() as client:
            jobs = [
                _complete(client, served.url, p, max_tokens=n, ignore_eos=True)
                for p, n in zip(PROMPTS, lengths, strict=True)
            ]
            return await asyncio.gather(*jobs)

    t0 = time.monotonic()
    results = asyncio.run(burst())
    assert time.monotonic() - t0 < BURST_WINDOW_S  # the burst filled the batch, no timeout
    assert served.stats.max_batch_size == len(PROMPTS)
    assert served.stats.batched_steps >= min(lengths)
    for p, n, got in zip(PROMPTS, lengths, results, strict=True):
        assert got == solo(tok.encode(p), max_new_tokens=n, ignore_eos=True), p


def test_prefill_joins_running_decodes(serve, model, tok, solo):
    """B arrives while A streams: B's prefill runs in the same step as A's decode tokens."""
    served = serve(model)
    long_n = 64  # A must still be decoding when B arrives (~1 s of steps on the tiny model)

    async def scenario():
        async with httpx.AsyncClient() as client:
            body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": long_n}
            body.update(temperature=0.0, ignore_eos=True, stream=True, return_token_ids=True)
            a_tokens = []
            b_task = None
            url = f"{served.url}/v1/completions"
            async with client.stream("POST", url, json=body, timeout=TIMEOUT_S) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    a_tokens += json.loads(line[6:])["choices"][0]["token_ids"]
                    if b_task is None:  # A is running: send B now
                        b_task = asyncio.create_task(
                            _complete(client, served.url, PROMPTS[1], max_tokens=6)
                        )
            return a_tokens, await b_task

    a_tokens, b_tokens = asyncio.run(scenario())
    assert served.stats.mixed_steps >= 1
    assert a_tokens == solo(tok.encode(PROMPTS[0]), max_new_tokens=long_n, ignore_eos=True)
    assert b_tokens == solo(tok.encode(PROMPTS[1]), max_new_tokens=6)


def test_request_past_its_deadline_gets_504(serve, model):
    served = serve(model, request_timeout_s=0.2)
    body = {"model": MODEL_NAME, "prompt": "slow", "max_tokens": 2000, "ignore_eos": True}
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 504
    assert "deadline exceeded" in r.json()["error"]["message"]
    assert served.frontend.engine.num_running == 0


def test_client_that_leaves_is_cancelled(serve, model):
    served = serve(model)
    body = {"model": MODEL_NAME, "prompt": "bye", "max_tokens": 2000, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{served.url}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT_S
    ) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert '"text"' in first
    deadline = time.monotonic() + TIMEOUT_S
    while served.frontend.engine.num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert served.frontend.engine.num_running == 0
    assert served.stats.tokens < 2000  # stopped long before max_tokens
    assert served.frontend.metrics.requests["cancelled"] == 1


def test_pressure_mixed_requests_each_equal_solo(serve, model, tok, solo):
    """Many overlapping requests, streamed and not, under a budget small enough that prompts
    are chunked and requests join and leave at every step: each result is its solo result."""
    served = serve(model, max_batch_tokens=24)
    jobs = [(f"request {i} " + "pad " * (i * 3 % 17), 3 + i % 6, i % 2 == 1) for i in range(12)]

    async def one(client, prompt, n, stream):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0.0}
        body.update(ignore_eos=True, return_token_ids=True, stream=stream)
        url = f"{served.url}/v1/completions"
        if not stream:
            r = await client.post(url, json=body, timeout=TIMEOUT_S)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        got = []
        async with client.stream("POST", url, json=body, timeout=TIMEOUT_S) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    got += json.loads(line[6:])["choices"][0]["token_ids"]
        return got

    async def run_all():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, *j) for j in jobs))

    results = asyncio.run(run_all())
    for (prompt, n, _), got in zip(jobs, results, strict=True):
        assert got == solo(tok.encode(prompt), max_new_tokens=n, ignore_eos=True), prompt
    assert served.stats.prefill_chunks >= 1 and served.stats.mixed_steps >= 1
    assert served.stats.step_failures == 0
