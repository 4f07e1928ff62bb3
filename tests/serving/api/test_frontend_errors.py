"""Bad requests get the right status and a message that says what is wrong; none of them
reaches the engine, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from frontend_helpers import MODEL_NAME

TIMEOUT_S = 60.0


def post(served, path, content=None, json=None):
    return httpx.post(f"{served.url}{path}", content=content, json=json, timeout=TIMEOUT_S)


def error_of(r, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status
    return err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_json_is_400(served, path):
    msg = error_of(post(served, path, content=b'{"model": "x", "prompt": '), 400)
    assert "not valid JSON" in msg


def test_body_must_be_an_object(served):
    assert "JSON object" in error_of(post(served, "/v1/completions", json=[1, 2]), 400)


def test_missing_field_is_named(served):
    msg = error_of(post(served, "/v1/completions", json={"model": MODEL_NAME}), 400)
    assert "prompt" in msg


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404(served, path):
    body = {"model": "gpt-17"}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    msg = error_of(post(served, path, json=body), 404)
    assert "gpt-17" in msg and MODEL_NAME in msg


def test_prompt_beyond_the_context_is_400(served, model):
    limit = model.config.max_position_embeddings
    body = {"model": MODEL_NAME, "prompt": "a" * 10, "max_tokens": limit}
    msg = error_of(post(served, "/v1/completions", json=body), 400)
    assert f"maximum context length is {limit}" in msg


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"n": 2}, "n=2"),
        ({"logprobs": 3}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"tools": []}, "tools: unsupported parameter"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt": ["one", "two"]}, "one prompt per request"),
        ({"prompt": [5, 99999]}, "token ids must be in"),
        ({"prompt": []}, "empty"),
        ({"stop": ["a"] * 9}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_unsupported_or_invalid_parameters_are_400(served, extra, says):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **extra}
    assert says in error_of(post(served, "/v1/completions", json=body), 400)


def test_chat_checks(served):
    msg = error_of(post(served, "/v1/chat/completions", json={"model": MODEL_NAME}), 400)
    assert "messages" in msg
    body = {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]}
    assert "role" in error_of(post(served, "/v1/chat/completions", json=body), 400)
    body = {"model": MODEL_NAME, "messages": [], "max_tokens": 2}
    assert "messages" in error_of(post(served, "/v1/chat/completions", json=body), 400)


def test_bad_streaming_request_is_refused_before_the_stream(served):
    body = {"model": "nope", "prompt": "hi", "stream": True}
    r = post(served, "/v1/completions", json=body)
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json")


def test_bad_requests_never_reach_the_engine(serve, model):
    fresh = serve(model)
    for body in ({"model": "x", "prompt": "a"}, {"model": MODEL_NAME, "prompt": "a", "n": 3}):
        assert post(fresh, "/v1/completions", json=body).status_code in (400, 404)
    assert post(fresh, "/v1/completions", content=b"nope").status_code == 400
    assert fresh.stats.steps == 0 and fresh.stats.failed == 0
    ok = post(fresh, "/v1/completions", json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200
