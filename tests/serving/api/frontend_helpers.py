"""Constants and SSE parsing shared by the front-end tests (a module with a unique name: several
conftest.py files exist in the tree, so tests do not import from conftest)."""

from __future__ import annotations

import json

MODEL_NAME = "tiny-mixtral"
# Enough for every prompt of these tests in one prefill, small enough to test the limit.
MAX_BATCH_TOKENS = 256


def sse_data(text: str) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream, in order."""
    events = [e for e in text.split("\n\n") if e.strip()]
    out = []
    for e in events:
        assert e.startswith("data: "), f"not an SSE data event: {e!r}"
        out.append(e[len("data: ") :])
    return out


def sse_chunks(text: str) -> tuple[list[dict], bool]:
    """(JSON chunks, whether the stream ended with [DONE])."""
    data = sse_data(text)
    done = bool(data) and data[-1] == "[DONE]"
    body = data[:-1] if done else data
    assert "[DONE]" not in body, "[DONE] must be the last event"
    return [json.loads(d) for d in body], done
