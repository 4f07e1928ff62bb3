"""A front end's side of the prefill/decode split over real HTTP and a real KV hand-off (shm):
POST /pd/prefill on a prefill front end, then /pd/decode on a decode front end, give the tokens
the plain /v1/completions gives; every malformed or mismatched call is a clear 4xx (or 502/504
naming the cause) and both front ends keep serving; /metrics counts the hand-offs."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from frontend_helpers import MODEL_NAME
from moecomm_serving.disagg import routes as pd_routes
from moecomm_serving.disagg.schema import DecodeCall, PrefillAnswer, PrefillCall
from moecomm_serving.types import SamplingParams

TIMEOUT_S = 60.0
PROMPTS = ([5, 6, 7], list(range(1, 40)), [200] * 17)
NEW = 7
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(serve, model):
    prefill = serve(model, role="prefill", kv_block_tokens=8)
    decode = serve(model, role="decode", kv_block_tokens=8)
    return prefill, decode


def plain(serve_url, ids, params):
    body = {
        "model": MODEL_NAME,
        "prompt": ids,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{serve_url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def prefill_call(pair, ids, params, hid="h1", decode_url=None):
    prefill, decode = pair
    call = PrefillCall(hid, list(ids), params, decode_url or decode.url)
    return httpx.post(f"{prefill.url}/pd/prefill", json=call.to_json(), timeout=TIMEOUT_S)


def decode_stream(pair, body):
    _, decode = pair
    with httpx.stream("POST", f"{decode.url}/pd/decode", json=body, timeout=TIMEOUT_S) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        return 200, [json.loads(line) for line in r.iter_lines() if line]


def split(pair, ids, params, hid="h1"):
    r = prefill_call(pair, ids, params, hid)
    assert r.status_code == 200, r.text
    answer = PrefillAnswer.from_json(r.content)
    call = DecodeCall.after_prefill(PrefillCall(hid, list(ids), params, pair[1].url), answer)
    status, lines = decode_stream(pair, call.to_json())
    assert status == 200, lines
    assert lines[-1]["finish"] == "length"
    return [answer.token] + [x["token"] for x in lines]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_split_over_http_equals_plain(pair, params):
    prefill, _ = pair
    for i, ids in enumerate(PROMPTS):
        assert split(pair, ids, params, hid=f"eq{i}") == plain(prefill.url, ids, params)


def test_metrics_count_the_handoffs(pair):
    split(pair, PROMPTS[0], GREEDY, hid="m")
    prefill, decode = pair
    sent = httpx.get(f"{prefill.url}/metrics", timeout=TIMEOUT_S).text
    got = httpx.get(f"{decode.url}/metrics", timeout=TIMEOUT_S).text
    assert 'moecomm_kv_handoff_handoffs_total{direction="sent"}' in sent
    assert 'moecomm_kv_handoff_sent_by_transport_total{transport="shm"}' in sent
    assert 'moecomm_kv_handoff_handoffs_total{direction="received"} 0' not in got
    info = httpx.get(f"{decode.url}/pd/info", timeout=TIMEOUT_S).json()
    assert info == {"role": "decode", "model": MODEL_NAME, "block_tokens": 8}


def test_roles_refuse_the_other_side(pair):
    prefill, decode = pair
    r = httpx.post(f"{decode.url}/pd/prefill", content=b"{}", timeout=TIMEOUT_S)
    assert r.status_code == 404 and "decode" in r.json()["error"]["message"]
    r = httpx.post(f"{prefill.url}/pd/decode", content=b"{}", timeout=TIMEOUT_S)
    assert r.status_code == 404 and "prefill" in r.json()["error"]["message"]


def test_malformed_calls_are_400(pair):
    prefill, decode = pair
    for url in (f"{prefill.url}/pd/prefill", f"{decode.url}/pd/decode"):
        for raw in (b"not json", b"[]", b'{"handoff_id": "x"}'):
            r = httpx.post(url, content=raw, timeout=TIMEOUT_S)
            assert r.status_code == 400, (url, raw, r.text)
            assert r.json()["error"]["message"]
    r = prefill_call(pair, [10**6], GREEDY)  # a token id outside the vocabulary
    assert r.status_code == 400


def test_mismatched_handoff_is_refused_and_nothing_leaks(pair):
    prefill, decode = pair
    ids = PROMPTS[1]
    a = prefill_call(pair, ids, GREEDY, hid="real").json()
    kv = a["kv"]
    # another request's id: the package is not this request's
    wrong = DecodeCall("other", ids, [a["token"]], GREEDY, None, kv["client_id"], kv["tag"])
    status, body = decode_stream(pair, wrong.to_json())
    assert status == 400 and "hand-off 'real'" in body["error"]["message"]
    # a prompt that does not match the package's length
    a = prefill_call(pair, ids, GREEDY, hid="len").json()
    kv = a["kv"]
    short = DecodeCall("len", ids[:-1], [a["token"]], GREEDY, None, kv["client_id"], kv["tag"])
    status, body = decode_stream(pair, short.to_json())
    assert status == 400 and "holds" in body["error"]["message"]
    # a sampled request without its sampler state
    a = prefill_call(pair, ids, SAMPLED, hid="rng").json()
    kv = a["kv"]
    norng = DecodeCall("rng", ids, [a["token"]], SAMPLED, None, kv["client_id"], kv["tag"])
    status, body = decode_stream(pair, norng.to_json())
    assert status == 400 and "rng" in body["error"]["message"]
    # both still serve, and nothing is left in the decode pool
    assert split(pair, ids, GREEDY, hid="after") == plain(prefill.url, ids, GREEDY)
    assert decode.frontend.engine.pool.num_used == 0


def test_missing_package_times_out_with_504(pair, monkeypatch):
    monkeypatch.setattr(pd_routes, "KV_ARRIVAL_TIMEOUT_S", 0.5)
    call = DecodeCall("ghost", [1, 2], [3], GREEDY, None, 12345, 1)
    status, body = decode_stream(pair, call.to_json())
    assert status == 504 and "did not arrive" in body["error"]["message"]


def test_unreachable_decode_is_502(pair):
    r = prefill_call(pair, PROMPTS[0], GREEDY, hid="gone", decode_url="http://127.0.0.1:9")
    assert r.status_code == 502 and "127.0.0.1:9" in r.json()["error"]["message"]
    # the prefill front end still hands off to a live one
    assert split(pair, PROMPTS[0], GREEDY, hid="alive")


LONG = SamplingParams(max_new_tokens=1800, ignore_eos=True)
# A hung-up stream's request must stop well before its 1800 tokens would be done (~10 s on
# the tiny model here).
STOP_WITHIN_S = 3.0


def wait_idle(frontend, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if frontend.engine.num_running == 0 and frontend.engine.queue_depth == 0:
            return True
        time.sleep(0.05)
    return False


def test_a_client_that_hangs_up_stops_its_request(pair):
    """Both streaming paths: the decode NDJSON stream and the OpenAI SSE stream. The request
    is cancelled within moments of the hang-up, not run on to its 1800 tokens for nobody."""
    prefill, decode = pair
    a = prefill_call(pair, PROMPTS[0], LONG, hid="gone").json()
    kv = a["kv"]
    call = DecodeCall("gone", PROMPTS[0], [a["token"]], LONG, None, kv["client_id"], kv["tag"])
    with httpx.stream(
        "POST", f"{decode.url}/pd/decode", json=call.to_json(), timeout=TIMEOUT_S
    ) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert json.loads(next(lines))["finish"] is None
    assert wait_idle(decode.frontend, STOP_WITHIN_S), "the decode request ran on"
    body = {"model": MODEL_NAME, "prompt": [1, 2], "max_tokens": 1800, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{prefill.url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    assert wait_idle(prefill.frontend, STOP_WITHIN_S), "the streamed request ran on"
