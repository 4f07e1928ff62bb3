"""Hostile and broken input: oversized and deeply nested bodies, malformed requests of every
kind, a stream that fails half-way, a huge prompt beside /health, and a missing or malformed
checkpoint on the command line. Each gets a 4xx (or an error event) in OpenAI's error shape and
the server keeps serving; the CLI prints one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from frontend_helpers import MODEL_NAME, sse_chunks
from moecomm_serving.model.tiny import write_tiny
from moecomm_serving.model.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer, load_tokenizer
from moecomm_serving.model.transformer import load_model
from tokenizer_files import write_checkpoint

TIMEOUT_S = 60.0
SMALL_BODY_LIMIT = 64 << 10
# Far deeper than Python's recursion limit (1000), so a recursive parser must give up.
NESTING = 100_000
# A prompt this long takes a tokenizer.json ~1 s to encode (the tokenizers package releases the
# GIL meanwhile); /health must not wait for it.
HUGE_PROMPT_BYTES = 2 << 20
HEALTH_FAST_S = 0.5
# /health is probed this often while the huge prompt is in flight.
HEALTH_PROBES, HEALTH_PROBE_GAP_S = 5, 0.1


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and "type" in err
    return err


def assert_still_serving(url: str) -> None:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2, "temperature": 0},
        timeout=TIMEOUT_S,
    )
    assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/health", timeout=TIMEOUT_S).status_code == 200


@pytest.fixture(scope="module")
def small(serve, model):
    return serve(model, max_body_bytes=SMALL_BODY_LIMIT)


def test_oversized_body_is_413_declared_or_chunked(small):
    big = json.dumps({"model": MODEL_NAME, "prompt": "x" * SMALL_BODY_LIMIT}).encode()
    url = f"{small.url}/v1/completions"
    assert "exceeds" in error_of(httpx.post(url, content=big, timeout=TIMEOUT_S), 413)["message"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    error_of(httpx.post(url, content=chunks(), timeout=TIMEOUT_S), 413)
    with pytest.raises(openai.APIStatusError) as err:
        openai.OpenAI(base_url=f"{small.url}/v1", api_key="-").completions.create(
            model=MODEL_NAME, prompt="x" * SMALL_BODY_LIMIT, max_tokens=1
        )
    assert err.value.status_code == 413
    assert_still_serving(small.url)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deeply_nested_json_is_400(served, path):
    body = '{"model": "m", "prompt": ' + "[" * NESTING + "]" * NESTING + "}"
    err = error_of(httpx.post(f"{served.url}{path}", content=body, timeout=TIMEOUT_S), 400)
    assert "nested too deeply" in err["message"]
    assert_still_serving(served.url)


MALFORMED = [
    ("POST", "/v1/completions", b"\xff\xfe not utf-8", 400),
    ("POST", "/v1/completions", b"", 400),
    ("POST", "/v1/completions", b'"a string"', 400),
    ("POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": {"a": 1}}), 400),
    ("POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": [1.5]}), 400),
    ("POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": "a", "top_p": 2}), 400),
    ("POST", "/v1/chat/completions", json.dumps({"model": MODEL_NAME, "messages": [{}]}), 400),
    ("POST", "/v1/chat/completions", json.dumps({"model": MODEL_NAME, "messages": "hi"}), 400),
    ("POST", "/v1/chat/completions", json.dumps({"model": [], "messages": []}), 400),
    ("GET", "/v1/completions", None, 405),
    ("POST", "/v1/embeddings", b"{}", 404),
    ("GET", "/nowhere", None, 404),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), MALFORMED)
def test_malformed_requests_get_an_openai_error(served, method, path, body, status):
    r = httpx.request(method, f"{served.url}{path}", content=body, timeout=TIMEOUT_S)
    error_of(r, status)


def test_server_keeps_serving_after_every_malformed_request(served):
    for method, path, body, status in MALFORMED:
        r = httpx.request(method, f"{served.url}{path}", content=body, timeout=TIMEOUT_S)
        assert r.status_code == status
    assert_still_serving(served.url)


def test_openai_client_gets_typed_errors(served):
    c = openai.OpenAI(base_url=f"{served.url}/v1", api_key="-", timeout=TIMEOUT_S)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL_NAME, prompt="a", max_tokens=1, logprobs=2)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="a", max_tokens=1)
    stream = c.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A model with more ids than the byte tokenizer can decode: a library user who passes the
    byte tokenizer anyway (load_tokenizer refuses it) gets sampled tokens it cannot decode."""
    path = tmp_path_factory.mktemp("wide")
    write_tiny(str(path), overrides={"vocab_size": BYTE_VOCAB_SIZE + 200})
    return load_model(path, dtype=torch.float32)


def test_an_error_during_a_stream_ends_it_with_an_error_event(serve, wide_model):
    served = serve(wide_model, tokenizer=ByteTokenizer())
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 64, "seed": 1, "stream": True}
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200
    chunks, done = sse_chunks(r.text)  # a cut connection would raise while reading
    assert not done and chunks[-1]["error"]["code"] == 500
    assert "outside the byte vocabulary" in chunks[-1]["error"]["message"]
    r = httpx.post(
        f"{served.url}/v1/completions", json={**body, "stream": False}, timeout=TIMEOUT_S
    )
    assert error_of(r, 500)["type"] == "server_error"
    assert httpx.get(f"{served.url}/health", timeout=TIMEOUT_S).status_code == 200


def test_health_stays_fast_while_a_huge_prompt_is_tokenized(serve, model, tmp_path, tiny_dir):
    path = write_checkpoint(tmp_path / "ckpt", tiny_dir, add_bos=False, chat_template=None)
    served = serve(model, tokenizer=load_tokenizer(path, model.config))
    text = "hello world " * (HUGE_PROMPT_BYTES // len("hello world "))
    body = json.dumps({"model": MODEL_NAME, "prompt": text, "max_tokens": 1})
    result = {}

    def send():
        t = time.monotonic()
        r = httpx.post(f"{served.url}/v1/completions", content=body, timeout=TIMEOUT_S)
        result["status"], result["s"] = r.status_code, time.monotonic() - t

    t = threading.Thread(target=send)
    t.start()
    health_s = []
    while t.is_alive() and len(health_s) < HEALTH_PROBES:
        t0 = time.monotonic()
        assert httpx.get(f"{served.url}/health", timeout=TIMEOUT_S).status_code == 200
        health_s.append(time.monotonic() - t0)
        time.sleep(HEALTH_PROBE_GAP_S)
    t.join(TIMEOUT_S)
    assert result["status"] == 400  # longer than the context
    assert max(health_s) < HEALTH_FAST_S, f"/health took {max(health_s):.2f} s"


def moecomm(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MOECOMM_TRACEBACK", None)
    cmd = [sys.executable, "-m", "moecomm_serving.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def test_cli_checkpoint_errors_print_one_line(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    cases = [
        (["expert-server", "--checkpoint", str(tmp_path / "missing")], "no config.json"),
        (["frontend", "--checkpoint", str(bad), "--local-experts"], "not valid JSON"),
        (["tiny", "--out", os.devnull + "/x"], "Not a directory"),
    ]
    for argv, what in cases:
        p = moecomm(*argv)
        assert p.returncode == 1, p.stderr
        assert "Traceback" not in p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"moecomm {argv[0]}: ") and what in lines[0]
