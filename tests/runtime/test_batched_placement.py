"""Placement changes in batches, on real expert-server processes: a server that gains several
experts rebuilds each layer's weights once and publishes them in one epoch (what brings
redundancy back quickly after a kill), drops go in one epoch too, a peer's experts come in one
export, and a client never sees an expert leave before its new copy is routable."""

import time

import httpx
import pytest
import torch
from moecomm.runtime.experts import LayerExperts
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.runtime.placement import PlacementController
from moecomm.testing.clients import connect_client

SPEC = ModelSpec(num_layers=2, num_experts=8, hidden=64, intermediate=32, seed=11)
TOKEN = "t0ken"
TOPK = 2
MAX_TOKENS = 16
# Leaving experts are freed once every client acked; a test waits at most this long for it.
FREE_DEADLINE_S = 30.0


@pytest.fixture
def procs():
    started = []

    def spawn(hosted: dict[int, list[int]], name: str):
        started.append(spawn_expert_server(SPEC, hosted, name, TOKEN))
        return started[-1]

    try:
        yield spawn
    finally:
        for p in started:
            p.stop()


def table(url: str) -> dict:
    r = httpx.get(f"{url}/experts", params={"load": "false"}, timeout=10)
    r.raise_for_status()
    return r.json()


def make_client(urls):
    return connect_client(urls, SPEC.hidden, TOPK, MAX_TOKENS, token=TOKEN, timeout=20.0)


def check_outputs(c, layer: int, experts: list[int], seed: int) -> None:
    """Dispatches tokens routed to `experts` of `layer`; every output equals the monolith."""
    g = torch.Generator().manual_seed(seed)
    want_experts = SPEC.experts()[layer]
    for _ in range(3):  # round robin: each replica gets some
        n = 2 * len(experts)
        ids = torch.tensor(
            [[e, experts[(i + 1) % len(experts)]] for i, e in enumerate(experts)] * 2
        )
        ids = ids[:n].to(torch.int32)
        x = torch.randn(n, SPEC.hidden, generator=g)
        w = torch.rand(n, TOPK, generator=g)
        y = c.combine(c.dispatch(x, ids, w, layer))
        (want,) = LayerExperts(layer, want_experts).forward([x], [ids], [w])
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_a_restore_loads_a_servers_experts_in_one_batch_one_rebuild_per_layer(procs):
    """Server b holds experts 0-2 of both layers, a all eight: with two copies asked for, the
    restore pass loads 3-7 of both layers on b — ten experts in one request, each layer rebuilt
    once (the server's own counter) and one new epoch; the per-expert path took ten of each."""
    a = procs({la: list(range(8)) for la in (0, 1)}, "a")
    b = procs({la: [0, 1, 2] for la in (0, 1)}, "b")
    before = table(b.url)
    controller = PlacementController([a.url, b.url], TOKEN, min_replicas=2, min_tokens=10**12)
    report = controller.restore()
    assert report is not None and not report.errors, report
    after = table(b.url)
    assert report.replicas_loaded == 10
    assert after["epoch"] - before["epoch"] == 1  # published at once
    assert after["layer_builds"] - before["layer_builds"] == 2  # one per layer
    assert report.load_batches == 1
    for la in ("0", "1"):
        assert sorted(e for e in after["layers"][la] if e >= 0) == list(range(8))
    assert controller.restore() is None  # every expert has its two copies now
    c = make_client([b.url])  # b alone: every answer comes from the weights it loaded
    try:
        for la in (0, 1):
            check_outputs(c, la, list(range(3, 8)), seed=la)
    finally:
        c.close()


@pytest.mark.timeout(240)
def test_a_batch_from_a_peer_comes_in_one_export_and_refusals_change_nothing(procs):
    a = procs({0: list(range(8))}, "a")
    b = procs({0: [0, 1]}, "b")
    body = {
        "experts": [
            {"layer": 0, "expert": e, "source": "peer", "peer": a.url} for e in (2, 3, 5, 6, 7)
        ]
        + [{"layer": 0, "expert": 4, "source": "checkpoint"}],
        "token": TOKEN,
    }
    epoch = table(b.url)["epoch"]
    r = httpx.post(f"{b.url}/experts/load_batch", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["sources"] == {"peer": 5, "checkpoint": 1} and out["added"] == 6
    assert out["bytes"] == 6 * 3 * SPEC.hidden * SPEC.intermediate * 4
    after = table(b.url)
    assert after["epoch"] == epoch + 1 and after["layers"]["0"] == [0, 1, 2, 3, 5, 6, 7, 4]
    c = make_client([b.url])
    try:
        check_outputs(c, 0, list(range(2, 8)), seed=3)
    finally:
        c.close()
    # All or nothing: one expert already hosted refuses the whole batch (layer 1 stays away),
    # so do a name given twice and a peer that does not host the expert; nothing changes.
    again = {
        "experts": [{"layer": 1, "expert": 0}, {"layer": 0, "expert": 5}],
        "token": TOKEN,
    }
    assert httpx.post(f"{b.url}/experts/load_batch", json=again).status_code == 409
    twice = {"experts": [{"layer": 0, "expert": 2}] * 2, "token": TOKEN}
    assert httpx.post(f"{b.url}/experts/load_batch", json=twice).status_code == 400
    absent = {"experts": [{"layer": 1, "expert": 0, "source": "peer", "peer": a.url}]}
    r = httpx.post(f"{b.url}/experts/load_batch", json={**absent, "token": TOKEN}, timeout=30)
    assert r.status_code == 400 and "cannot export" in r.text
    assert httpx.post(f"{b.url}/experts/load_batch", json={**absent, "token": "x"}).status_code == (
        401
    )
    empty = {"experts": [], "token": TOKEN}
    assert httpx.post(f"{b.url}/experts/load_batch", json=empty).status_code == 422
    now = table(b.url)
    assert now["epoch"] == epoch + 1 and now["layers"] == {"0": [0, 1, 2, 3, 5, 6, 7, 4]}
    # Drops in one epoch; one naming an expert not hosted refuses the batch.
    gone = {"experts": [{"layer": 0, "expert": 9}, {"layer": 0, "expert": 5}], "token": TOKEN}
    assert httpx.post(f"{b.url}/experts/unload_batch", json=gone).status_code == 404
    builds = table(b.url)["layer_builds"]
    drop = {"experts": [{"layer": 0, "expert": e} for e in (5, 6, 7)], "token": TOKEN}
    r = httpx.post(f"{b.url}/experts/unload_batch", json=drop)
    assert r.status_code == 200 and r.json()["epoch"] == epoch + 2 and r.json()["marked"] == 3
    until = time.monotonic() + FREE_DEADLINE_S
    while table(b.url)["leaving"]:  # no client connected: freed once the loop has polled
        assert time.monotonic() < until
        time.sleep(0.05)
    final = table(b.url)
    assert final["layers"]["0"] == [0, 1, 2, 3, -1, -1, -1, 4]
    assert final["epoch"] == epoch + 3 and final["layer_builds"] == builds + 1  # freed at once


class _MoveAfterRead:
    """Server 0's epoch word, read for real; right after the first read the move happens on the
    servers (new copy on server 0, then the old one leaving on server 1): the interleaving a
    client meets when a move lands between its reads of two servers' words."""

    def __init__(self, word, move):
        self.word, self.move, self.armed = word, move, True

    def read(self) -> int:
        epoch = self.word.read()
        if self.armed:
            self.armed = False
            self.move()
        return epoch

    def close(self) -> None:
        self.word.close()


@pytest.mark.timeout(240)
def test_a_client_never_sees_an_expert_leave_before_its_new_copy(procs):
    b = procs({0: [0, 1, 2, 3]}, "b")  # server 0 of the client: gains expert 4
    a = procs({0: [0, 1, 2, 3, 4, 5, 6, 7]}, "a")  # server 1: expert 4 leaves it
    c = make_client([b.url, a.url])
    try:

        def move() -> None:
            body = {"layer": 0, "expert": 4, "token": TOKEN}
            r = httpx.post(f"{b.url}/experts/load", json=body, timeout=60)
            assert r.status_code == 200, r.text
            r = httpx.post(f"{a.url}/experts/unload", json=body, timeout=60)
            assert r.status_code == 200, r.text

        c.pool.epoch_words[0] = _MoveAfterRead(c.pool.epoch_words[0], move)
        c.pool.refresh_placement()
        assert not c.missing, f"expert(s) without a route after the move: {c.missing}"
        assert [s for s, _ in c.maps[0].replicas(4)] == [0]  # on its new server only
        check_outputs(c, 0, [4, 5], seed=4)
    finally:
        c.close()
