"""Attention clients as tests and benchmarks set them up: float32 in and out (bit-exact against a
float32 reference), connected to every server before they are handed over."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from moecomm.runtime.client import AttentionClient


def server_urls(servers: Sequence) -> list[str]:
    """URLs from URLs, or from objects with a ``url`` (ServerProcess, testing.Proc)."""
    return [s if isinstance(s, str) else s.url for s in servers]


def connect_client(
    servers: Sequence,
    hidden: int,
    topk: int,
    max_tokens: int,
    client_id: int | None = None,
    **kw,
) -> AttentionClient:
    """An AttentionClient over `servers` (URLs, or objects with a ``url``) with f32 activations
    and outputs, connected (connect() closes it again when it fails). `client_id` None draws a
    random id; `kw` goes to AttentionClient (timeout, token, num_slots, evict_s, ...; encoding
    and out_dtype may be overridden too)."""
    kw.setdefault("encoding", "f32")
    kw.setdefault("out_dtype", torch.float32)
    client = AttentionClient(server_urls(servers), client_id, hidden, topk, max_tokens, **kw)
    client.connect()  # closes the client itself when it fails
    return client


@contextlib.contextmanager
def attention_client(*args, **kw) -> Iterator[AttentionClient]:
    """connect_client(...) for a ``with`` block: closed at its end, whatever happened."""
    client = connect_client(*args, **kw)
    try:
        yield client
    finally:
        client.close()
