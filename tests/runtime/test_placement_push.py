"""Placement epochs pushed, not read (issue 30, item 2): a ServerPlacement in its own process,
over its own NIXL agent, writes every epoch change into the word a client handed it
(subscribe); the client learns each change by loading its own memory, with no transfer of its
own. A second subscription replaces the first, forget() stops the pushes, and a client that
misses a push still has the stale-map rule (not exercised here: placement tests cover it).
End to end (real expert server processes, an AttentionClient, shm and nixl): the client hands
each server a word at connect, a placement change on a server reaches that word with no epoch
READ by the client, and the client routes by the new table; a malformed word is refused with a
400 and the server keeps serving. Seeds are fixed; deadlines are seconds."""

from __future__ import annotations

import time

import httpx
import moecomm.wire.nixl
import pytest
import torch
from moecomm.runtime import AttentionClient
from moecomm.runtime.control import http_connect, http_disconnect
from moecomm.runtime.experts import ExpertWeights, LayerExperts
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.runtime.registry import ClientRegistry
from moecomm.runtime.server_placement import EpochWord, ServerPlacement
from moecomm.wire.choose import make_transport
from moecomm.wire.client import ClientChannel
from nixl_helpers import NIXL_OK, NIXL_WHY, SEED, recv, spawn

needs_nixl = pytest.mark.skipif(not NIXL_OK, reason=f"NIXL is not installed: {NIXL_WHY}")
pytestmark = pytest.mark.timeout(180)

HIDDEN, INTERMEDIATE = 16, 8
LAYER = 0
# A pushed epoch is in the client's memory well within this (one notification across the
# host); generous for a shared 2-core machine.
PUSH_DEADLINE_S = 10.0
CHANGES = 5


def _placement_server(conn):
    """A ServerPlacement over nixl that adds an expert per "add" command and reports the epoch;
    ("subscribe", id, handle) and ("forget", id) are passed through."""
    t = moecomm.wire.nixl.open_nixl_transport()
    g = torch.Generator().manual_seed(SEED)
    placement = ServerPlacement({}, HIDDEN, t, ClientRegistry("push-test"))
    conn.send(placement.epoch)
    expert = 0
    while (cmd := conn.recv())[0] != "stop":
        if cmd[0] == "subscribe":
            placement.subscribe(cmd[1], t, cmd[2])
            conn.send(placement.subscribers())
        elif cmd[0] == "forget":
            placement.forget(cmd[1])
            conn.send(placement.subscribers())
        elif cmd[0] == "add":
            w = ExpertWeights(
                torch.randn(INTERMEDIATE, HIDDEN, generator=g),
                torch.randn(INTERMEDIATE, HIDDEN, generator=g),
                torch.randn(HIDDEN, INTERMEDIATE, generator=g),
            )
            conn.send(placement.add(LAYER, expert, w)["epoch"])
            expert += 1
    placement.close()
    conn.send("bye")


def _until(word: EpochWord, want: int) -> int:
    """Loads our own word until it holds `want`; returns it (or the last value at the deadline)."""
    deadline = time.monotonic() + PUSH_DEADLINE_S
    v = word.read()
    while v != want and time.monotonic() < deadline:
        time.sleep(1e-4)
        v = word.read()
    return v


@needs_nixl
def test_every_epoch_change_is_pushed_into_the_client_word(reaper):
    _p, conn, first = spawn(reaper, _placement_server)
    t = moecomm.wire.nixl.open_nixl_transport()
    word = EpochWord(t)
    assert word.read() == 0  # nothing pushed yet
    conn.send(("subscribe", 7, word.handle))
    assert recv(conn) == [7]
    assert _until(word, first) == first  # the current epoch at once
    reads = t.engine.transfers_by_op["READ"]
    for _ in range(CHANGES):
        conn.send(("add",))
        epoch = recv(conn)
        assert _until(word, epoch) == epoch
    # Each change took one signal from the server and no transfer from us: we only loaded.
    assert t.engine.transfers_by_op["READ"] == reads
    assert t.engine.notifications_received >= CHANGES

    # A second word replaces the first: the old one is no longer written.
    fresh = EpochWord(t)
    conn.send(("subscribe", 7, fresh.handle))
    assert recv(conn) == [7]
    assert _until(fresh, epoch) == epoch
    conn.send(("add",))
    epoch = recv(conn)
    assert _until(fresh, epoch) == epoch
    assert word.read() == epoch - 1

    # forget (the client left): no more pushes.
    conn.send(("forget", 7))
    assert recv(conn) == []
    conn.send(("add",))
    later = recv(conn)
    assert later == epoch + 1
    time.sleep(0.2)  # a push, had there been one, lands well within this
    assert fresh.read() == epoch
    conn.send(("stop",))
    assert recv(conn) == "bye"


# ------------------------------------------------------------------ end to end, over HTTP
SPEC = ModelSpec(num_layers=1, num_experts=8, hidden=32, intermediate=16, seed=11)
TOKEN = "t0ken"
TOPK = 2
MAX_TOKENS = 16
# Server "a" starts with experts 0-3, "b" with 4-7; the test then moves expert MOVED from b to a.
HOSTED_A = {LAYER: [0, 1, 2, 3]}
HOSTED_B = {LAYER: [4, 5, 6, 7]}
MOVED = 5
DISPATCHES = 6
# f32 sums of the same terms in another order differ by a few ulps.
F32_RTOL, F32_ATOL = 1e-5, 1e-5
TRANSPORTS = ["shm", pytest.param("nixl", marks=needs_nixl)]


def _client(urls, transport):
    return AttentionClient(
        urls,
        None,
        SPEC.hidden,
        TOPK,
        MAX_TOKENS,
        encoding="f32",
        out_dtype=torch.float32,
        token=TOKEN,
        timeout=20.0,
        transport=transport,
    )


def _batch(seed):
    """Every token routes to MOVED and one other expert, so each dispatch uses the moved one."""
    g = torch.Generator().manual_seed(seed)
    n = MAX_TOKENS
    other = torch.randint(0, SPEC.num_experts - 1, (n,), generator=g)
    other = other + (other >= MOVED).long()  # any expert but MOVED
    ids = torch.stack([torch.full((n,), MOVED), other], dim=1).to(torch.int32)
    return torch.randn(n, SPEC.hidden, generator=g), ids, torch.rand(n, TOPK, generator=g)


def _reference(x, ids, w):
    (y,) = LayerExperts(LAYER, SPEC.experts()[LAYER]).forward([x], [ids], [w])
    return y.float()


def _close(got, want) -> bool:
    """Equal up to f32 summation order: the servers' partials are summed per server, and which
    server holds which expert changes under the test."""
    return torch.allclose(got, want, rtol=F32_RTOL, atol=F32_ATOL)


def _forward(client, x, ids, w):
    return client.combine(client.dispatch(x, ids, w, LAYER))


def _reads(client) -> int:
    """Transfers of kind READ the client's transports made (nixl counts them; shm has none: a
    load there is of mapped memory either way)."""
    engines = {id(e): e for ch in client.pool.channels if (e := getattr(ch.transport, "engine", 0))}
    return sum(e.transfers_by_op["READ"] for e in engines.values())


def _replicas(client, expert: int) -> list[int]:
    """The servers the client's map sends `expert` of LAYER to."""
    return sorted(server for server, _ in client.pool.maps[LAYER].replicas(expert))


def _post(url: str, route: str, expert: int) -> dict:
    r = httpx.post(
        f"{url}/experts/{route}",
        json={"layer": LAYER, "expert": expert, "token": TOKEN},
        timeout=30.0,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _served(url: str, expert: int) -> int:
    """Tokens the server at `url` computed for `expert` of LAYER so far."""
    r = httpx.get(f"{url}/experts", params={"load": True}, timeout=10.0)
    assert r.status_code == 200, r.text
    return sum(c["tokens"] for c in r.json()["load"] if c["expert"] == expert)


def _until_read(word, want: int) -> int:
    deadline = time.monotonic() + PUSH_DEADLINE_S
    v = word.read()
    while v < want and time.monotonic() < deadline:
        time.sleep(1e-3)
        v = word.read()
    return v


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    name = request.param
    procs = []
    try:
        procs.append(spawn_expert_server(SPEC, HOSTED_A, "push-a", TOKEN, transport=name))
        procs.append(spawn_expert_server(SPEC, HOSTED_B, "push-b", TOKEN, transport=name))
        yield name, procs
    finally:
        for p in procs:
            p.stop()


def test_a_placement_change_reaches_the_client_without_an_epoch_read(pair):
    name, (a, b) = pair
    client = _client([a.url, b.url], name)
    client.connect()
    try:
        assert [ch.transport.name for ch in client.pool.channels] == [name, name]
        # Both servers took our words: the epochs live in our memory, theirs is never mapped.
        assert all(isinstance(w, EpochWord) for w in client.pool.epoch_words)
        assert _replicas(client, MOVED) == [1]
        x, ids, w = _batch(SEED)
        assert _close(_forward(client, x, ids, w), _reference(x, ids, w))
        reads = _reads(client)

        # Expert MOVED is loaded on a (its checkpoint) and then unloaded from b: two changes
        # on two servers, each pushed into the word we handed that server.
        epoch_a = _post(a.url, "load", MOVED)["epoch"]
        assert _until_read(client.pool.epoch_words[0], epoch_a) == epoch_a
        epoch_b = _post(b.url, "unload", MOVED)["epoch"]
        assert _until_read(client.pool.epoch_words[1], epoch_b) == epoch_b
        served_b = _served(b.url, MOVED)
        served_a = _served(a.url, MOVED)

        for step in range(DISPATCHES):
            x, ids, w = _batch(SEED + 1 + step)
            assert _close(_forward(client, x, ids, w), _reference(x, ids, w))
        # The client picked up both tables (acked by its GETs) and routes MOVED to a only. (b
        # frees MOVED once we acked, another change: its epoch may be one past the unload's.)
        assert client.pool.epochs[0] == epoch_a
        assert client.pool.epochs[1] >= epoch_b
        assert _replicas(client, MOVED) == [0]
        assert _served(a.url, MOVED) == served_a + DISPATCHES * MAX_TOKENS
        assert _served(b.url, MOVED) == served_b
        # Not one READ for all of it: no per-micro-batch read of a server's epoch word.
        assert _reads(client) == reads
    finally:
        client.close()


def test_a_malformed_placement_word_is_refused_and_the_server_keeps_serving(pair):
    name, (a, _b) = pair
    probe = _client([a.url], name)  # for its slot layout only
    t = make_transport(name)
    ch = ClientChannel(t, probe.layout, 77, 2, name="malformed")
    try:
        with pytest.raises(ConnectionError, match=r"\(400\).*placement_word"):
            http_connect(
                a.url,
                77,
                ch.handle,
                probe.layout,
                2,
                TOKEN,
                20.0,
                transport=name,
                extra={"placement_word": "no-such-word"},
            )
        # Refused whole: the id was not kept, so the same client connects at once without it.
        info = http_connect(a.url, 77, ch.handle, probe.layout, 2, TOKEN, 20.0, transport=name)
        assert info["placement_pushed"] is False
        http_disconnect(a.url, 77, TOKEN, timeout=20.0, session=info["session"])
    finally:
        ch.close()
    # And the server serves a client on the same transport as before.
    client = _client([a.url], name)
    client.connect()
    try:
        g = torch.Generator().manual_seed(SEED)
        x = torch.randn(4, SPEC.hidden, generator=g)
        ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]], dtype=torch.int32)
        w = torch.rand(4, TOPK, generator=g)
        assert _close(_forward(client, x, ids, w), _reference(x, ids, w))
        assert isinstance(client.pool.epoch_words[0], EpochWord)
    finally:
        client.close()
