"""`moecomm router` over prefill and decode front ends: for every model family the split answers
exactly what one front end answers (greedy and seeded sampling, streaming or not, prompts of
one to several KV blocks); malformed requests get a 4xx and the router keeps serving; the CLI
refuses a front end of the wrong role, an unreachable one and a malformed list. Conditional
disaggregation (--max-local-prefill-tokens): short prompts and prompts the decode front end's
prefix cache holds are prefilled there, with the same tokens, counted by path; in that
deployment every process holds the deployment secret and the router an API key, and each is
required where it should be. The retry and replay rules themselves are pinned on scripted
front ends (in-process fakes speaking the protocol), where every failure can be placed
exactly."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import subprocess
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from moecomm.auth import generate
from moecomm.http_thread import HttpServer
from moecomm.testing import FrontendSpec, Processes, start_local_cluster
from moecomm_serving.api.auth import PD_SECRET_ENV
from moecomm_serving.cli import main as cli
from moecomm_serving.disagg.router import MAX_ATTEMPTS, Router, make_router_app
from moecomm_serving.disagg.schema import DecodeToken, KvReceipt, PrefillAnswer
from moecomm_serving.model.tiny import write_tiny
from moecomm_serving.model.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer
from pd_procs import CLI, HTTP_TIMEOUT_S, MODEL_NAME, Stream, completion, metric

# Families served by real expert servers (the issue: both roles use them as today); the others
# run their experts in each front end to keep the machine's two cores for the rest.
WITH_EXPERT_SERVERS = ("mixtral", "deepseek_v3")
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# Prompts of one token up to a few KV blocks (16 tokens each by default), text and token ids,
# so the hand-off carries a partial block, whole blocks and several.
PROMPTS = ["a", "The experts are", "moecomm moves tokens between processes" * 2, list(range(3, 67))]
MAX_TOKENS = 12
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
END_S = 120.0  # a stream of the tiny model through the router, on a loaded machine


@pytest.fixture(scope="module")
def deployed(request, tmp_path_factory):
    """Per family: the split (one prefill front end, one decode front end, the router) over
    the same experts. Every role keeps the OpenAI routes, and the prefill front end answering a
    request all by itself is the single front end the split must equal (the same engine path as
    a front end without a role; a process fewer on a two-core machine). Yields (router URL,
    single URL, prefill URL, decode URL)."""
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"pd-{arch}")
    ckpt = tmp / "tiny"
    write_tiny(str(ckpt), arch, seed=0)
    with start_local_cluster(
        ckpt,
        servers=["all"] if arch in WITH_EXPERT_SERVERS else [],
        frontends=[FrontendSpec("prefill"), FrontendSpec("decode")],
        # every request split: these tests pin the hand-off (conditional routing: below)
        router=["--max-local-prefill-tokens", "0"],
        model_name=MODEL_NAME,
        procs=Processes(tmp / "procs"),
        id_prefix="pd-test",
    ) as cluster:
        prefill, decode = cluster.frontend_urls
        yield cluster.router_url, prefill, prefill, decode


@pytest.mark.timeout(240)
@pytest.mark.parametrize("deployed", ARCHS, indirect=True)
def test_split_answers_exactly_what_one_front_end_answers(deployed):
    router, single, *_ = deployed
    for prompt in PROMPTS:
        want = completion(single, prompt, MAX_TOKENS, ignore_eos=True)
        assert len(want) == MAX_TOKENS
        assert completion(router, prompt, MAX_TOKENS, ignore_eos=True) == want, prompt
        stream = Stream(router, prompt, MAX_TOKENS, ignore_eos=True)
        assert stream.result(time.monotonic() + END_S) == want, prompt
    # one token: the prefill ends the request, nothing is handed off
    assert completion(router, "x", 1) == completion(single, "x", 1)
    assert metric(router, 'moecomm_router_retries_total{phase="prefill"}') == 0
    assert metric(router, 'moecomm_router_retries_total{phase="decode"}') == 0
    assert metric(router, "moecomm_router_handoffs_total") == 2 * len(PROMPTS)
    assert metric(router, "moecomm_router_kv_bytes_total") > 0


def _chat(url: str, **extra) -> dict:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Hello experts"}],
        "max_tokens": MAX_TOKENS,
        "return_token_ids": True,
        **extra,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("deployed", ["mixtral"], indirect=True)
def test_seeded_sampling_through_the_router_equals_one_front_end(deployed):
    router, single, *_ = deployed
    for prompt in PROMPTS[1:3]:
        want = completion(single, prompt, MAX_TOKENS, ignore_eos=True, **SEEDED)
        assert completion(router, prompt, MAX_TOKENS, ignore_eos=True, **SEEDED) == want
        stream = Stream(router, prompt, MAX_TOKENS, ignore_eos=True, **SEEDED)
        assert stream.result(time.monotonic() + END_S) == want
    a, b = _chat(router, **SEEDED), _chat(single, **SEEDED)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"] == b["usage"]


MALFORMED = [
    ("POST", "/v1/completions", b"\xff\xfe not utf-8", 400),
    ("POST", "/v1/completions", b"{", 400),
    ("POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": [1.5]}), 400),
    ("POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": [10**6]}), 400),
    ("POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": "a", "n": 2}), 400),
    ("POST", "/v1/completions", json.dumps({"model": "other", "prompt": "a"}), 404),
    (
        "POST",
        "/v1/completions",
        json.dumps({"model": MODEL_NAME, "prompt": "a", "max_tokens": 10**6}),
        400,
    ),
    ("POST", "/v1/chat/completions", json.dumps({"model": MODEL_NAME, "messages": "hi"}), 400),
    ("GET", "/v1/completions", None, 405),
    ("GET", "/pd/info", None, 404),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("deployed", ["mixtral"], indirect=True)
def test_malformed_requests_get_a_4xx_and_the_router_keeps_serving(deployed):
    router, single, *_ = deployed
    for method, path, body, status in MALFORMED:
        r = httpx.request(method, f"{router}{path}", content=body, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == status, (path, body, r.text)
        assert r.json()["error"]["message"]
    assert completion(router, "ok", 4) == completion(single, "ok", 4)
    health = httpx.get(f"{router}/health", timeout=HTTP_TIMEOUT_S)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    models = httpx.get(f"{router}/v1/models", timeout=HTTP_TIMEOUT_S).json()
    assert models["data"][0]["id"] == MODEL_NAME


def _free_port_url() -> str:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("deployed", ["mixtral"], indirect=True)
def test_cli_refuses_wrong_roles_unreachable_and_malformed_front_ends(deployed, tmp_path):
    _, _, prefill, decode = deployed
    ckpt = tmp_path / "tiny"
    write_tiny(str(ckpt), "mixtral", seed=0)
    plain = Fake()  # a server without /pd/info
    try:
        cases = [
            ((decode, decode), "role 'decode'; --prefill takes role 'prefill' or 'both'"),
            ((prefill, prefill), "role 'prefill'; --decode takes role 'decode' or 'both'"),
            ((plain.url, decode), "not a prefill/decode front end"),
            ((_free_port_url(), decode), "does not answer"),
            ((prefill, decode, "--model-name", "other"), "serves model 'tiny', the router 'other'"),
            ((",", decode), "--prefill needs at least one"),
            ((f"{prefill},{prefill}", decode), "names a front end twice"),
            (("localhost:80", decode), "not a front end's base URL"),
            ((prefill, f"{decode}/v1"), "not a front end's base URL"),
        ]
        for args, message in cases:  # in this process: each start would import torch anew
            argv = ["router", "--checkpoint", str(ckpt), "--prefill", args[0], "--decode", args[1]]
            with pytest.raises(SystemExit, match=re.escape(message)):
                cli.main([*argv, *(args[2:] or ("--model-name", MODEL_NAME))])
    finally:
        plain.server.stop()
    # and once from the command line: one line on stderr, no traceback, a failing exit status
    argv = ["router", "--checkpoint", str(ckpt), "--model-name", MODEL_NAME]
    out = subprocess.run(
        [*CLI, *argv, "--prefill", decode, "--decode", decode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "role 'decode'" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


# ---------------------------------------------------------------------------------------------
# The retry and replay rules, on scripted front ends.

FAKE_TIMEOUT_S = 2.0  # the router's backend timeout against the fakes
WATCH_S = 0.02  # how often a fake checks whether the router hung up


class Fake:
    """A front end speaking the protocol from a script: `prefill(call_no, body)` returns
    (status, JSON); `decode` is a list of token lines and then "drop" (the connection is cut
    before the request finished) or nothing (the last line carries finish)."""

    def __init__(self, prefill=None, decode=(), token_gap_s=0.0, local=(), cached=None):
        self.prefill_calls, self.decode_calls = [], []
        self.local_calls, self.cached_calls = [], []
        self.script_prefill, self.script_decode = prefill, list(decode)
        self.stream_gone = threading.Event()  # a decode stream's connection ended
        self._watchers: set[asyncio.Task] = set()
        app = FastAPI()

        @app.post("/pd/prefill")
        async def pd_prefill(request: Request):
            body = await request.json()
            self.prefill_calls.append(body)
            status, answer = self.script_prefill(len(self.prefill_calls), body)
            return JSONResponse(answer, status)

        @app.post("/pd/decode")
        async def pd_decode(request: Request):
            self.decode_calls.append(await request.json())

            async def lines():
                for item in self.script_decode:
                    if item == "drop":
                        raise RuntimeError("scripted drop")  # uvicorn cuts the response
                    await asyncio.sleep(token_gap_s)
                    yield (json.dumps(item) + "\n").encode()

            async def watch():
                # uvicorn notices the router's hang-up when a send fails; the generator then
                # stays suspended until collected, so the connection is watched instead
                # (it also reads as gone once the response is complete)
                while not await request.is_disconnected():
                    await asyncio.sleep(WATCH_S)
                self.stream_gone.set()

            self._watchers.add(asyncio.create_task(watch()))

            return StreamingResponse(lines(), media_type="application/x-ndjson")

        @app.post("/v1/completions")
        async def completions(request: Request):
            # a local prefill: `local` is a list of SSE chunks, and then "drop" or nothing
            self.local_calls.append(await request.json())

            async def events():
                for item in local:
                    if item == "drop":
                        raise RuntimeError("scripted drop")
                    yield f"data: {json.dumps(item)}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/pd/cached")
        async def pd_cached(request: Request):
            # `cached`: tokens its prefix cache holds of any prompt; None: it has no cache
            self.cached_calls.append(await request.json())
            return {"cached_tokens": cached or 0, "prefix_cache": cached is not None}

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        self.server = HttpServer(app)
        self.url = self.server.start()


def _first(token=0, finish=None):
    kv = None if finish else KvReceipt(1, 7, 100, 0.01, "shm")
    return 200, PrefillAnswer(token, finish, kv, None, 0.0, 0).to_json()


def _tok(t, finish=None):
    return DecodeToken(t, finish).to_json()


def _chunk(ids, finish=None):
    """One SSE chunk of a front end's streamed /v1/completions with return_token_ids."""
    return {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": finish}]}


@pytest.fixture
def fakes():
    made, servers = [], []

    def start(prefill_urls, decode_urls, **kwargs):
        kwargs.setdefault("max_local_prefill_tokens", 0)  # the split's rules, unless asked
        r = Router(
            ByteTokenizer(),
            MODEL_NAME,
            BYTE_VOCAB_SIZE,
            2048,
            prefill_urls,
            decode_urls,
            backend_timeout_s=FAKE_TIMEOUT_S,
            **kwargs,
        )
        server = HttpServer(make_router_app(r))
        servers.append(server)
        return r, server.start()

    def fake(**kw):
        f = Fake(**kw)
        made.append(f)
        return f

    yield start, fake
    for s in servers:
        s.stop()
    for f in made:
        f.server.stop()


def _complete(url: str, max_tokens=8) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": max_tokens}
    body |= {"temperature": 0, "return_token_ids": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)


@pytest.mark.timeout(60)
def test_a_lost_decode_front_end_is_replayed_and_the_client_sees_each_token_once(fakes):
    start, fake = fakes
    p = fake(prefill=lambda n, b: _first(0))
    lost = fake(decode=[_tok(1), _tok(2), "drop"])
    good = fake(decode=[_tok(1), _tok(2), _tok(3, "length")])
    router, url = start([p.url], [lost.url, good.url])
    r = _complete(url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [0, 1, 2, 3]
    assert len(p.prefill_calls) == 2 and p.prefill_calls[1]["decode_url"] == good.url
    replay = good.decode_calls[0]
    assert replay["tokens"] == [0] and replay["kv"] == {"client_id": 1, "tag": 7}
    assert router.router_metrics.retries == {"prefill": 0, "decode": 1}
    assert p.prefill_calls[0]["handoff_id"] != p.prefill_calls[1]["handoff_id"]


@pytest.mark.timeout(60)
def test_a_replay_that_differs_from_what_the_client_has_is_an_error(fakes):
    start, fake = fakes
    p = fake(prefill=lambda n, b: _first(0))
    lost = fake(decode=[_tok(1), _tok(2), "drop"])
    other = fake(decode=[_tok(1), _tok(5), _tok(3, "length")])
    _, url = start([p.url], [lost.url, other.url])
    r = _complete(url)
    assert r.status_code == 500 and "replay diverged at token 2" in r.text, r.text


@pytest.mark.timeout(60)
def test_unreachable_and_failing_prefill_front_ends_are_skipped(fakes):
    start, fake = fakes
    broken = fake(prefill=lambda n, b: (500, {"error": {"message": "forward failed"}}))
    good = fake(prefill=lambda n, b: _first(4, "length"))
    router, url = start([_free_port_url(), broken.url, good.url], [good.url])
    for _ in range(2):
        r = _complete(url, max_tokens=1)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == [4]
    # the first request met both bad ones; the second picked the good one at once
    assert router.router_metrics.retries["prefill"] == 2
    health = httpx.get(f"{url}/health", timeout=HTTP_TIMEOUT_S).json()
    assert [b["healthy"] for b in health["prefill"]] == [False, True, True]


@pytest.mark.timeout(60)
def test_a_4xx_from_a_front_end_reaches_the_client_without_a_retry(fakes):
    start, fake = fakes
    p = fake(prefill=lambda n, b: (400, {"error": {"message": "prompt refused: reasons"}}))
    router, url = start([p.url], [p.url])
    r = _complete(url)
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt refused: reasons"
    assert len(p.prefill_calls) == 1 and router.router_metrics.retries["prefill"] == 0


@pytest.mark.timeout(60)
def test_no_live_front_end_of_a_role_is_a_503_not_a_hang(fakes):
    start, fake = fakes
    p = fake(prefill=lambda n, b: _first(0))
    dead = _free_port_url()
    _, url = start([p.url], [dead])
    t0 = time.monotonic()
    r = _complete(url)
    assert r.status_code == 503 and f"failed on {MAX_ATTEMPTS} tries" in r.text, r.text
    assert time.monotonic() - t0 < HTTP_TIMEOUT_S / 2
    health = httpx.get(f"{url}/health", timeout=HTTP_TIMEOUT_S)
    assert health.status_code == 503 and "no decode front end" in health.json()["error"]
    assert metric(url, 'moecomm_router_backends_healthy{role="decode"}') == 0
    assert metric(url, 'moecomm_router_backends_healthy{role="prefill"}') == 1


@pytest.mark.timeout(60)
def test_a_silent_decode_front_end_costs_one_backend_timeout(fakes):
    start, fake = fakes

    class Silent:  # accepts connections, never answers (a stopped process)
        def __init__(self):
            self.sock = socket.socket()
            self.sock.bind(("127.0.0.1", 0))
            self.sock.listen(16)
            self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    silent = Silent()
    try:
        p = fake(prefill=lambda n, b: _first(0))
        good = fake(decode=[_tok(1), _tok(2, "stop")])
        router, url = start([p.url], [silent.url, good.url])
        t0 = time.monotonic()
        r = _complete(url)
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [0, 1, 2]
        assert FAKE_TIMEOUT_S <= took < FAKE_TIMEOUT_S + 10, took
        assert router.router_metrics.retries["decode"] == 1
    finally:
        silent.sock.close()


@pytest.mark.timeout(60)
def test_a_client_that_leaves_closes_the_decode_stream(fakes):
    start, fake = fakes
    slow_s, n = 0.1, 100  # per token: the stream takes 10 s when nobody leaves
    p = fake(prefill=lambda n, b: _first(0))
    d = fake(decode=[_tok(t) for t in range(1, n)] + [_tok(n, "length")], token_gap_s=slow_s)
    router, url = start([p.url], [d.url])
    body = {"model": MODEL_NAME, "prompt": [1], "max_tokens": n + 1, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
        # leave once the decode stream runs (the prefill's token and then two of the decode's)
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)
        assert len(d.decode_calls) == 1
        left = time.monotonic()
    assert d.stream_gone.wait(HTTP_TIMEOUT_S / 4)
    assert time.monotonic() - left < n * slow_s / 2, "the decode stream ran on"
    assert not router.requests  # the request's task ended with it


AFFINITY_PREFIXES = 6  # prompt families, spread over 3 prefill front ends
AFFINITY_REPEATS = 3  # requests per family


def _complete_ids(url: str, ids: list[int]) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)


@pytest.mark.timeout(60)
def test_prompts_sharing_a_prefix_go_to_one_prefill_front_end(fakes):
    """Prefix affinity: every request of a prompt family (same first 64 tokens, different
    tails) lands on the same prefill front end, so its prefix cache sees them all; families
    spread over the front ends; with the family's front end gone, its requests move to another
    and stay together."""
    start, fake = fakes
    ps = [fake(prefill=lambda n, b: _first(0, "length")) for _ in range(3)]
    _, url = start([p.url for p in ps], [ps[0].url])
    rnd = random.Random(7)
    families = [[rnd.randrange(256) for _ in range(64)] for _ in range(AFFINITY_PREFIXES)]

    def home_of(prefix) -> set[int]:
        homes = set()
        for _ in range(AFFINITY_REPEATS):
            before = [len(p.prefill_calls) for p in ps]
            tail = [rnd.randrange(256) for _ in range(rnd.randint(1, 9))]
            assert _complete_ids(url, prefix + tail).status_code == 200
            homes |= {i for i, p in enumerate(ps) if len(p.prefill_calls) > before[i]}
        return homes

    homes = [home_of(f) for f in families]
    assert all(len(h) == 1 for h in homes), homes
    assert len(set().union(*homes)) > 1, "every family went to one front end"
    # the home of family 0 goes away: its requests move, together, to one other front end
    lost = next(iter(homes[0]))
    ps[lost].server.stop()
    moved = home_of(families[0])
    assert len(moved) == 1 and lost not in moved
    # other families whose home is alive keep it (rendezvous hashing moves only lost keys)
    for f, h in zip(families[1:], homes[1:], strict=True):
        if lost not in h:
            assert home_of(f) == h


# ---------------------------------------------------------------------------------------------
# Conditional disaggregation on scripted front ends.


def _complete_prompt(url: str, ids: list[int], max_tokens=8) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    body |= {"return_token_ids": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)


def _paths(router) -> dict:
    return dict(router.router_metrics.prefills)


@pytest.mark.timeout(60)
def test_short_prompts_are_prefilled_on_the_decode_front_end(fakes):
    start, fake = fakes
    p = fake(prefill=lambda n, b: _first(0))
    d = fake(
        decode=[_tok(1), _tok(2, "length")],
        local=[_chunk([5]), _chunk([6, 7]), _chunk([], "stop")],  # a finish on its own
    )
    router, url = start([p.url], [d.url], max_local_prefill_tokens=8)
    r = _complete_prompt(url, [1, 2, 3, 4, 5, 6, 7, 8])  # 8 tokens: short
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [5, 6, 7] and choice["finish_reason"] == "stop"
    assert not p.prefill_calls and not d.decode_calls and not d.cached_calls
    (body,) = d.local_calls
    assert body["prompt"] == list(range(1, 9)) and body["max_tokens"] == 8
    assert body["stream"] and body["return_token_ids"] and body["temperature"] == 0
    # 9 tokens: too long to be short, and the decode front end holds nothing: split
    r = _complete_prompt(url, list(range(1, 10)), max_tokens=3)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [0, 1, 2]
    assert len(p.prefill_calls) == 1 and len(d.cached_calls) == 1
    # it said it has no prefix cache: not asked again
    assert _complete_prompt(url, list(range(1, 10)), max_tokens=3).status_code == 200
    assert len(d.cached_calls) == 1
    assert _paths(router) == {"local_short": 1, "local_cached": 0, "split": 2}
    assert metric(url, 'moecomm_router_prefills_total{path="local_short"}') == 1
    assert metric(url, 'moecomm_router_prefills_total{path="split"}') == 2
    assert metric(url, "moecomm_router_cached_questions_total") == 1
    assert metric(url, "moecomm_router_handoffs_total") == 2


@pytest.mark.timeout(60)
def test_a_prompt_the_decode_side_mostly_holds_is_prefilled_there(fakes):
    start, fake = fakes
    p = fake(prefill=lambda n, b: _first(0))
    holds16 = fake(decode=[_tok(1), _tok(2, "length")], local=[_chunk([9], "length")], cached=16)
    router, url = start([p.url], [holds16.url], max_local_prefill_tokens=8)
    long = list(range(1, 25))  # 24 tokens, 16 held: 8 left to prefill
    r = _complete_prompt(url, long, max_tokens=1)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [9]
    assert holds16.cached_calls == [{"prompt": long}] and not p.prefill_calls
    r = _complete_prompt(url, list(range(1, 26)), max_tokens=3)  # 9 left: split
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [0, 1, 2]
    assert _paths(router) == {"local_short": 0, "local_cached": 1, "split": 1}


@pytest.mark.timeout(60)
def test_a_lost_local_prefill_is_replayed_and_never_sends_a_token_twice(fakes):
    start, fake = fakes
    lost = fake(local=[_chunk([5]), _chunk([6]), "drop"])
    good = fake(local=[_chunk([5, 6]), _chunk([7], "length")])
    router, url = start([good.url], [lost.url, good.url], max_local_prefill_tokens=8)
    r = _complete_prompt(url, [1, 2, 3], max_tokens=3)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [5, 6, 7]
    assert len(lost.local_calls) == 1 and len(good.local_calls) == 1
    assert router.router_metrics.retries == {"prefill": 0, "decode": 1}
    assert _paths(router)["local_short"] == 2
    health = httpx.get(f"{url}/health", timeout=HTTP_TIMEOUT_S).json()
    assert [b["healthy"] for b in health["decode"]] == [True, True]  # /health probed it back


# ---------------------------------------------------------------------------------------------
# Conditional disaggregation on real processes, with the deployment secret and an API key.

LOCAL_LIMIT = 24  # --max-local-prefill-tokens of the conditional router
API_KEY = "router-api-key-0123456789"
DECODE_CACHE_BYTES = 1 << 20


def _ids_completion(url: str, ids: list[int], n: int, headers=None) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": n, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)


def _streamed_tokens(url: str, ids: list[int], n: int, headers) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": n, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True, "stream": True}
    out, done = [], False
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                out += json.loads(line[len("data: ") :])["choices"][0].get("token_ids", [])
    assert done
    return out


def _tokens(url: str, ids: list[int], n: int, headers=None) -> list[int]:
    r = _ids_completion(url, ids, n, headers)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def conditional(tmp_path_factory):
    """A prefill and a decode front end (with a prefix cache) and a conditional router, every
    process holding one deployment secret (in its environment), the router an API key. Yields
    (router URL, prefill URL, decode URL, secret, checkpoint)."""
    tmp = tmp_path_factory.mktemp("pd-conditional")
    ckpt = tmp / "tiny"
    write_tiny(str(ckpt), "mixtral", seed=0)
    secret = generate()
    with start_local_cluster(
        ckpt,
        frontends=[
            FrontendSpec("prefill"),
            FrontendSpec("decode", ("--prefix-cache-bytes", str(DECODE_CACHE_BYTES))),
        ],
        router=["--max-local-prefill-tokens", str(LOCAL_LIMIT), "--api-key", API_KEY],
        model_name=MODEL_NAME,
        procs=Processes(tmp / "procs", env={**os.environ, PD_SECRET_ENV: secret}),
        id_prefix="pd-cond",
    ) as cluster:
        prefill, decode = cluster.frontend_urls
        yield cluster.router_url, prefill, decode, secret, ckpt


def _series(url: str, path: str) -> float:
    return metric(url, f'moecomm_router_prefills_total{{path="{path}"}}')


@pytest.mark.timeout(240)
def test_conditional_router_prefills_short_and_held_prompts_on_the_decode_side(conditional):
    router, single, _decode, _, _ = conditional
    key = {"Authorization": f"Bearer {API_KEY}"}
    rnd = random.Random(3)
    short = [rnd.randrange(3, 250) for _ in range(LOCAL_LIMIT)]
    n = LOCAL_LIMIT
    first = _tokens(router, short, n, key)
    assert first == _tokens(single, short, n)
    assert (_series(router, "local_short"), _series(router, "split")) == (1, 0)
    # the next turn: the first one's prompt and answer, and a few new tokens. The decode front
    # end kept the first turn's full blocks (32 of its 47 tokens), so 24 are left: prefilled
    # there, after one question
    turn = short + first + [rnd.randrange(3, 250) for _ in range(8)]
    assert _tokens(router, turn, 8, key) == _tokens(single, turn, 8)
    assert _series(router, "local_cached") == 1
    assert metric(router, "moecomm_router_cached_questions_total") == 1
    # a long prompt nobody holds: split, with a hand-off
    fresh = [rnd.randrange(3, 250) for _ in range(2 * LOCAL_LIMIT)]
    assert _tokens(router, fresh, 8, key) == _tokens(single, fresh, 8)
    assert _series(router, "split") == 1
    assert metric(router, "moecomm_router_handoffs_total") == 1
    # streaming takes the same paths
    assert _streamed_tokens(router, short, n, key) == first
    assert _series(router, "local_short") == 2


@pytest.mark.timeout(240)
def test_the_router_takes_its_api_key_and_the_front_ends_the_deployment_secret(conditional):
    router, prefill, decode, secret, _ = conditional
    ids = [5, 6, 7]
    assert _ids_completion(router, ids, 2).status_code == 401
    assert _ids_completion(router, ids, 2, {"Authorization": "Bearer wrong"}).status_code == 403
    # the deployment secret is the front ends' credential, not a client's key at the router
    assert _ids_completion(router, ids, 2, {"Authorization": f"Bearer {secret}"}).status_code == 403
    for path in ("/health", "/metrics"):
        assert httpx.get(router + path, timeout=HTTP_TIMEOUT_S).status_code == 200
    bearer = {"Authorization": f"Bearer {secret}"}
    for url, path in ((prefill, "/pd/prefill"), (decode, "/pd/decode"), (decode, "/pd/cached")):
        r = httpx.post(url + path, json={}, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 401, (path, r.text)
        r = httpx.post(url + path, json={}, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 403, (path, r.text)
        r = httpx.post(url + path, json={}, headers=bearer, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 400, (path, r.text)  # past the guard: the body is checked
    r = httpx.get(f"{decode}/pd/info", headers=bearer, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["role"] == "decode"


@pytest.mark.timeout(240)
def test_a_router_with_another_secret_is_refused_at_start(conditional, monkeypatch):
    _, prefill, decode, secret, ckpt = conditional
    argv = ["router", "--checkpoint", str(ckpt), "--model-name", MODEL_NAME]
    argv += ["--prefill", prefill, "--decode", decode]
    monkeypatch.setenv(PD_SECRET_ENV, "another-" + secret)
    with pytest.raises(SystemExit, match="refused the deployment secret"):
        cli.main(argv)
    monkeypatch.delenv(PD_SECRET_ENV)
    with pytest.raises(SystemExit, match="refused the deployment secret"):
        cli.main(argv)
