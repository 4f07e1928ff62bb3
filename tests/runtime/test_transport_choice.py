"""The runtime over the nixl transport on one host, and how each peer pair picks its transport:
nixl end to end, `auto` picking shm only where the probe proves shared /dev/shm, forced choices
that cannot work refused with a clear error, and the missing extra named."""

from __future__ import annotations

import pytest
import torch
from moecomm import prefork
from moecomm.errors import MoecommError
from moecomm.runtime import AttentionClient
from moecomm.runtime.experts import LayerExperts
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.wire.choose import TransportSet, choose

nixl_ok, nixl_why = __import__("moecomm.wire.nixl", fromlist=["available"]).available()
needs_nixl = pytest.mark.skipif(not nixl_ok, reason=f"NIXL is not installed: {nixl_why}")

SPEC = ModelSpec(num_layers=2, num_experts=8, hidden=64, intermediate=32, seed=5)
TOKEN = "t0ken"
TOPK = 2


def _client(urls, transport, **kw):
    return AttentionClient(
        urls,
        None,
        SPEC.hidden,
        TOPK,
        64,
        encoding="f32",
        out_dtype=torch.float32,
        token=TOKEN,
        timeout=20.0,
        transport=transport,
        **kw,
    )


def _reference(x, ids, w, layer):
    (y,) = LayerExperts(layer, SPEC.experts()[layer]).forward([x], [ids], [w])
    return y.float()


def _batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, SPEC.hidden, generator=g)
    ids = torch.stack([torch.randperm(SPEC.num_experts, generator=g)[:TOPK] for _ in range(n)])
    return x, ids.to(torch.int32), torch.rand(n, TOPK, generator=g)


@pytest.fixture(scope="module")
def servers():
    """s-nixl serves over nixl only, s-auto over both; both host every expert."""
    procs = []
    try:
        everything = {0: list(range(8)), 1: list(range(8))}
        if nixl_ok:
            procs.append(spawn_expert_server(SPEC, everything, "s-nixl", TOKEN, transport="nixl"))
            procs.append(spawn_expert_server(SPEC, everything, "s-auto", TOKEN, transport="auto"))
        yield procs
    finally:
        for p in procs:
            p.stop()


@needs_nixl
@pytest.mark.timeout(120)
def test_dispatch_over_nixl_matches_the_monolith_with_sizes_changing_every_step(servers):
    client = _client([servers[0].url], "nixl")
    client.connect()
    try:
        assert [ch.transport.name for ch in client.pool.channels] == ["nixl"]
        for step in range(12):
            n = 1 + (step * 7) % 64  # a new size every step, the largest the slot holds
            x, ids, w = _batch(n, step)
            layer = step % 2
            y = client.combine(client.dispatch(x, ids, w, layer))
            torch.testing.assert_close(y, _reference(x, ids, w, layer), rtol=1e-5, atol=1e-5)
    finally:
        client.close()


@needs_nixl
@pytest.mark.timeout(120)
def test_auto_speaks_shm_on_one_host_and_nixl_where_only_nixl_is_offered(servers):
    client = _client([s.url for s in servers], "auto")
    client.connect()
    try:
        # s-nixl offers nixl only; s-auto offers both and its probe proves our /dev/shm.
        assert [ch.transport.name for ch in client.pool.channels] == ["nixl", "shm"]
        for step in range(6):
            x, ids, w = _batch(5 + step, 100 + step)
            y = client.combine(client.dispatch(x, ids, w, 0))
            torch.testing.assert_close(y, _reference(x, ids, w, 0), rtol=1e-5, atol=1e-5)
    finally:
        client.close()


@needs_nixl
@pytest.mark.timeout(60)
def test_forcing_shm_against_a_nixl_only_server_is_a_clear_error(servers):
    client = _client([servers[0].url], "shm")
    with pytest.raises(MoecommError, match="offers transport nixl; this client speaks shm"):
        client.connect()
    client.close()


def test_auto_refuses_shm_when_the_probe_does_not_match():
    """Same boot id but another /dev/shm (two containers on one kernel): the probe word is not
    there, so auto must not pick shm, and a shm-only pair is refused."""
    from moecomm.wire.choose import boot_id

    offer = {
        "transports": ["shm"],
        "boot_id": boot_id(),
        "shm_probe": {"handle": "moecomm-1-1-1-deadbeef", "nonce": "12345"},
    }
    with pytest.raises(MoecommError, match="not on this host's shared memory"):
        choose(TransportSet("shm"), offer, "http://x")
    if nixl_ok:
        assert choose(TransportSet("auto"), {**offer, "transports": ["shm", "nixl"]}, "u") == "nixl"


def test_nixl_without_the_extra_names_it(monkeypatch):
    import moecomm.wire.nixl as nx

    monkeypatch.setattr(nx, "_NIXL_MODULES", ("moecomm_no_such_nixl._api",))
    with pytest.raises(MoecommError, match=r"pip install 'moecomm\[nixl\]'"):
        TransportSet("nixl")
    assert TransportSet("auto").names == ["shm"]  # auto falls back to shm, and says why


@needs_nixl
@pytest.mark.timeout(60)
def test_expert_weights_pulled_from_a_peer_over_nixl_are_bit_exact(servers):
    """Live re-placement across hosts: the exporter copies the expert into a region of the
    transport the reader speaks, the reader pulls it with one-sided READs."""
    from moecomm.runtime.weights import pull_from_peer
    from moecomm.wire.nixl import open_nixl_transport

    got = pull_from_peer(open_nixl_transport(), servers[0].url, 1, 3, TOKEN, 20.0)
    want = SPEC.experts()[1][3]
    for a, b in ((got.w1, want.w1), (got.w3, want.w3), (got.w2, want.w2)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _stopped_client(conn, url):
    """A nixl client that dispatches once and is then stopped by the test (never combines)."""
    c = _client([url], "nixl")
    c.connect()
    conn.send("connected")
    conn.recv()
    x, ids, w = _batch(4, 7)
    c.dispatch(x, ids, w, 0)
    conn.send("sent")
    conn.recv()  # stopped here by the parent, then killed


@needs_nixl
@pytest.mark.timeout(120)
def test_a_stopped_nixl_client_never_stalls_the_server_for_others():
    """A write over nixl waits for the peer's side of the transfer: the server's answer to a
    stopped client fails after SERVER_XFER_TIMEOUT_S instead of holding the loop."""
    import os
    import signal
    import time

    everything = {0: list(range(8)), 1: list(range(8))}
    # The batching window holds the stopped client's request until it is stopped.
    server = spawn_expert_server(
        SPEC, everything, "s-win", TOKEN, batching_window_s=0.3, transport="nixl"
    )
    ctx = prefork.process_context()
    a, b = ctx.Pipe()
    p = ctx.Process(target=_stopped_client, args=(b, server.url), daemon=True)
    try:
        p.start()
        assert a.poll(60) and a.recv() == "connected"
        healthy = _client([server.url], "nixl")
        healthy.connect()
        a.send("go")
        assert a.poll(30) and a.recv() == "sent"
        os.kill(p.pid, signal.SIGSTOP)
        for step in range(4):
            x, ids, w = _batch(3 + step, 50 + step)
            start = time.monotonic()
            y = healthy.combine(healthy.dispatch(x, ids, w, 0))
            # window 0.3 s + at most two 0.5 s writes to the stopped client + compute
            assert time.monotonic() - start < 3.0
            torch.testing.assert_close(y, _reference(x, ids, w, 0), rtol=1e-5, atol=1e-5)
        healthy.close()
    finally:
        if p.is_alive():
            p.kill()  # a forked one may be reaped already
            p.join(10)
        server.stop()


@pytest.mark.parametrize("offer", [{"transports": "shm"}, {"transports": [1]}, ["shm"], None])
def test_a_malformed_offer_is_a_clear_error(offer):
    with pytest.raises(MoecommError, match="answered GET /transports with something else"):
        choose(TransportSet("shm"), offer, "http://x")
