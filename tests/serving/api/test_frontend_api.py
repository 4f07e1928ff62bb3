"""Completions and chat completions through real HTTP: streaming and not, greedy and sampled,
token for token against in-process generation."""

from __future__ import annotations

import httpx
import pytest
from frontend_helpers import MAX_BATCH_TOKENS, MODEL_NAME, sse_chunks
from moecomm_serving.api.openai import ChatMessage, default_chat_template

TIMEOUT_S = 60.0
PROMPT = "The experts are"
MAX_TOKENS = 12


def post(served, path, body):
    return httpx.post(f"{served.url}{path}", json=body, timeout=TIMEOUT_S)


def completion(served, prompt=PROMPT, **kw):
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS}
    body.update({"temperature": 0.0, "return_token_ids": True, **kw})
    return post(served, "/v1/completions", body)


def test_completion_greedy_equals_generate(served, tok, solo):
    r = completion(served)
    assert r.status_code == 200, r.text
    body = r.json()
    want = solo(tok.encode(PROMPT), max_new_tokens=MAX_TOKENS)
    (choice,) = body["choices"]
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert choice["token_ids"] == want
    assert choice["text"] == tok.decode(want)
    assert choice["finish_reason"] == ("stop" if len(want) < MAX_TOKENS else "length")
    n_prompt = len(tok.encode(PROMPT))
    assert body["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": len(want),
        "total_tokens": n_prompt + len(want),
    }


def test_completion_token_id_prompt(served, tok, solo):
    ids = tok.encode("token ids in")
    r = completion(served, prompt=ids)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == solo(ids, max_new_tokens=MAX_TOKENS)


def test_completion_stream_one_chunk_per_token(served, tok, solo):
    r = completion(served, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks, done = sse_chunks(r.text)
    assert done
    want = solo(tok.encode(PROMPT), max_new_tokens=MAX_TOKENS)
    *token_chunks, usage_chunk = chunks
    assert [c["choices"][0]["token_ids"] for c in token_chunks] == [[t] for t in want]
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == tok.decode(want)
    assert [c["choices"][0]["finish_reason"] for c in token_chunks][-1] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks[:-1])
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(want)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_generate(served, tok, solo, stream):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name an expert."}]},
    ]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": MAX_TOKENS}
    body.update(temperature=0.0, stream=stream, return_token_ids=True)
    r = post(served, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    text = default_chat_template([ChatMessage.model_validate(m) for m in messages])
    want = solo(tok.encode(text), max_new_tokens=MAX_TOKENS)
    if stream:
        chunks, done = sse_chunks(r.text)
        assert done
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        got = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        content = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    else:
        out = r.json()
        assert out["object"] == "chat.completion"
        msg = out["choices"][0]["message"]
        assert msg["role"] == "assistant"
        got, content = out["choices"][0]["token_ids"], msg["content"]
    assert got == want
    assert content == tok.decode(want)


def test_chat_default_max_tokens_fills_the_context(served):
    """Without max_tokens a chat may use the rest of the context: the check must not refuse."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    body.update(stop_token_ids=list(range(259)))  # every token stops: one token comes back
    r = post(served, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def test_sampled_with_seed_is_reproducible(served, tok, solo):
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    first = completion(served, **params).json()["choices"][0]["token_ids"]
    second = completion(served, stream=True, **params)
    chunks, _ = sse_chunks(second.text)
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    want = solo(
        tok.encode(PROMPT), max_new_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1234
    )
    assert first == streamed == want
    other = completion(served, temperature=0.9, top_p=0.95, seed=4321, ignore_eos=True)
    assert other.json()["choices"][0]["token_ids"] != first  # the seed matters


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates(served, tok, solo, stream):
    want = solo(tok.encode(PROMPT), max_new_tokens=MAX_TOKENS, ignore_eos=True)
    full = tok.decode(want)
    # a stop string from the middle of the greedy output: a clean (non-replacement) character
    at = next(i for i in range(2, len(full)) if full[i] != "\ufffd")
    stop = full[at]
    expect = full[: full.find(stop)]
    r = completion(served, stop=[stop], ignore_eos=True, stream=stream)
    assert r.status_code == 200, r.text
    if stream:
        chunks, done = sse_chunks(r.text)
        assert done
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert text == expect
    assert finish == "stop"


def test_models_lists_the_served_model(served, model):
    r = httpx.get(f"{served.url}/v1/models", timeout=TIMEOUT_S)
    assert r.status_code == 200
    (card,) = r.json()["data"]
    assert card["id"] == MODEL_NAME
    assert card["max_model_len"] == model.config.max_position_embeddings


def test_prompt_longer_than_a_step_is_chunked(served, tok, solo):
    prompt = "x" * (MAX_BATCH_TOKENS + 40)  # more tokens than one step carries
    chunks_before = served.stats.prefill_chunks
    r = completion(served, prompt=prompt, max_tokens=4, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == solo(
        tok.encode(prompt), max_new_tokens=4, ignore_eos=True
    )
    assert served.stats.prefill_chunks >= chunks_before + 2
