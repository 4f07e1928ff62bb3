"""Live expert re-placement on serving expert servers (real processes): a controller moves
replicas while clients dispatch a skewed load that drifts, with sizes changing every step and two
micro-batches in flight. Nothing may be lost; every output must equal the monolith, bit for bit
against the grouping of the map the dispatch used."""

import threading
import time

import httpx
import pytest
import torch
from moecomm.errors import RemoteError
from moecomm.ops.dispatch import pack_dispatch
from moecomm.runtime import server_placement
from moecomm.runtime.control import HttpServer, make_app
from moecomm.runtime.experts import LayerExperts
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.runtime.placement import PlacementController
from moecomm.runtime.server import ExpertServer
from moecomm.testing.clients import connect_client, server_urls
from moecomm.wire.client import ClientChannel
from moecomm.wire.protocol import ResponseStatus, SlotLayout

SPEC = ModelSpec(num_layers=2, num_experts=12, hidden=64, intermediate=32, seed=5)
TOKEN = "t0ken"
TOPK = 2
MAX_TOKENS = 48
# Three servers, four experts each plus one replica: 15 slots for 12 experts.
HOSTED = [
    {layer: [*range(4 * i, 4 * i + 4), (4 * i + 4) % 12] for layer in (0, 1)} for i in range(3)
]
# A drop grace no test run reaches (server_placement.DROP_GRACE_S is 2 s): only acks release.
NO_GRACE_S = 3600.0
# How long a drop that the clients' acks release may take on a loaded machine (a liveness
# deadline: without the acks it would never land).
DROP_DEADLINE_S = 60.0


@pytest.fixture
def servers():
    procs = []
    try:
        for i, hosted in enumerate(HOSTED):
            procs.append(spawn_expert_server(SPEC, hosted, f"p{i}", TOKEN))
        yield procs
    finally:
        for p in procs:
            p.stop()


def make_client(servers, **kw):
    return connect_client(servers, SPEC.hidden, TOPK, MAX_TOKENS, token=TOKEN, timeout=20.0, **kw)


def skewed_batch(g, step, drift_every):
    """A batch whose size changes every step, routed mostly to three hot experts; the hot set
    moves on every `drift_every` steps."""
    n = int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=g))
    hot = {(3 * (step // drift_every) + j) % SPEC.num_experts for j in range(3)}
    p = torch.tensor([30.0 if e in hot else 1.0 for e in range(SPEC.num_experts)])
    first = torch.multinomial(p, n, replacement=True, generator=g)
    second = (first + 1 + torch.randint(0, SPEC.num_experts - 1, (n,), generator=g)) % 12
    ids = torch.stack([first, second], dim=1).to(torch.int32)
    x = torch.randn(n, SPEC.hidden, generator=g)
    w = torch.rand(n, TOPK, generator=g)
    return x, ids, w


def grouped_reference(x, ids, w, layer, emap, replica):
    """The runtime's summation order for the map a dispatch used: per server, its experts at the
    local indices that map names; partials summed in server order."""
    experts = SPEC.experts()[layer]
    y = torch.zeros(x.shape, dtype=torch.float32)
    for b in pack_dispatch(x, ids, w, emap, replica=replica):
        slots = {}
        for e in range(emap.num_experts):
            for s, j in emap.replicas(e):
                if s == b.server:
                    slots[j] = e
        table = [slots.get(j, -1) for j in range(max(slots) + 1)]
        server_layer = LayerExperts(layer, {e: experts[e] for e in slots.values()}, table)
        (part,) = server_layer.forward([b.activations], [b.expert_ids], [b.scores])
        y[b.token_index] += part.float()
    return y


def monolith(x, ids, w, layer):
    (y,) = LayerExperts(layer, SPEC.experts()[layer]).forward([x], [ids], [w])
    return y


def tables(servers):
    return [httpx.get(f"{u}/experts", timeout=10).json() for u in server_urls(servers)]


@pytest.mark.timeout(300)
def test_replacement_under_drifting_load_loses_nothing(servers):
    c = make_client(servers)
    controller = PlacementController(
        [s.url for s in servers], TOKEN, min_gain=0.02, min_tokens=64, windows=2
    )
    g = torch.Generator().manual_seed(0)
    steps, drift, exact = 240, 60, 0
    controller.start(0.25)
    try:
        pending = []
        for step in range(steps):
            layer = step % 2
            x, ids, w = skewed_batch(g, step, drift)
            h = c.dispatch(x, ids, w, layer)
            pending.append((h, c.maps[layer], (x, ids, w, layer), c.failovers))
            if len(pending) == 2 or step == steps - 1:  # two micro-batches in flight
                for h, emap, (x, ids, w, layer), failovers in pending:
                    y = c.combine(h)
                    torch.testing.assert_close(y, monolith(x, ids, w, layer), rtol=1e-5, atol=1e-6)
                    if c.failovers == failovers:  # no share re-sent: the dispatch's own grouping
                        want = grouped_reference(x, ids, w, layer, emap, h.replica)
                        assert torch.equal(y, want), f"step {step}"
                        exact += 1
                pending = []
            if step % 20 == 19:
                time.sleep(0.1)  # let the controller's pass land between micro-batches too
    finally:
        controller.stop()
        c.close()
    reports = [r for r in controller.reports if r.moves]
    assert reports, "the drifting skew never moved a replica"
    loaded = sum(r.replicas_loaded for r in reports)
    dropped = sum(r.replicas_dropped for r in reports)
    assert loaded > 0 and dropped > 0 and not any(r.errors for r in reports)
    assert all(r.imbalance_after < r.imbalance_before for r in reports)
    assert exact > steps // 2  # most steps never needed a re-send
    # Every server still serves: each expert of each layer has at least one published replica.
    for layer in (0, 1):
        published = {e for t in tables(servers) for e in t["layers"][str(layer)] if e >= 0}
        assert published == set(range(SPEC.num_experts))


@pytest.mark.timeout(180)
def test_peer_and_checkpoint_loads_and_refusals(servers):
    url0, url1 = servers[0].url, servers[1].url
    body = {"layer": 0, "expert": 9, "token": TOKEN}
    # Pulled from the peer that hosts it, over the transport.
    r = httpx.post(f"{url0}/experts/load", json={**body, "source": "peer", "peer": servers[2].url})
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == 3 * SPEC.hidden * SPEC.intermediate * 4
    r = httpx.post(f"{url1}/experts/load", json={**body, "source": "checkpoint"})
    assert r.status_code == 200, r.text
    t0 = tables(servers)[0]
    assert t0["layers"]["0"] == [0, 1, 2, 3, 4, 9]  # appended, nothing renumbered
    # The weights arrived intact: expert 9 has three replicas now, and the client's round robin
    # sends it to each of them in turn; every answer equals the monolith.
    c = make_client(servers)
    try:
        g = torch.Generator().manual_seed(1)
        ids = torch.tensor([[9, 0]] * 5, dtype=torch.int32)
        used = set()
        for _ in range(3):
            x = torch.randn(5, SPEC.hidden, generator=g)
            w = torch.rand(5, TOPK, generator=g)
            h = c.dispatch(x, ids, w, 0)
            used |= {s.server for s in h.sent}
            y = c.combine(h)
            torch.testing.assert_close(y, monolith(x, ids, w, 0), rtol=1e-5, atol=1e-6)
        assert used == {0, 1, 2}
    finally:
        c.close()
    # Refusals: twice the same expert, a bad token, a peer that does not host it, a missing one.
    assert (
        httpx.post(f"{url0}/experts/load", json={**body, "source": "checkpoint"}).status_code == 409
    )
    assert httpx.post(f"{url0}/experts/load", json={**body, "token": "x"}).status_code == 401
    r = httpx.post(
        f"{url0}/experts/load",
        json={"layer": 1, "expert": 11, "token": TOKEN, "source": "peer", "peer": url1},
    )
    assert r.status_code == 400 and "cannot export" in r.text
    bad = {"layer": 0, "expert": 7, "token": TOKEN}
    assert httpx.post(f"{url0}/experts/unload", json=bad).status_code == 404
    assert httpx.post(f"{url0}/experts/load", json={**body, "source": "disk"}).status_code == 422
    for s in servers:
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200


@pytest.mark.timeout(180)
def test_a_client_with_a_stale_map_is_told_and_resends(servers):
    """A client that read the old table just before a drop (forced here: its refresh is turned
    off) routes to the retired index: STALE_MAP, re-read, re-send — same output, no eviction."""
    c = make_client(servers)
    try:
        c.pool.refresh_placement = lambda: None
        g = torch.Generator().manual_seed(2)
        ids = torch.tensor([[4, 5]] * 6, dtype=torch.int32)  # expert 4: on p0 and p1
        r = httpx.post(
            f"{servers[0].url}/experts/unload", json={"layer": 0, "expert": 4, "token": TOKEN}
        )
        assert r.status_code == 200
        deadline = time.monotonic() + 20
        while tables(servers)[0]["leaving"]:  # the idle client is waited for DROP_GRACE_S
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert tables(servers)[0]["layers"]["0"] == [0, 1, 2, 3, -1]
        for _ in range(4):  # round robin: some go to p0's retired index
            x = torch.randn(6, SPEC.hidden, generator=g)
            w = torch.rand(6, TOPK, generator=g)
            y = c.combine(c.dispatch(x, ids, w, 0))
            torch.testing.assert_close(y, monolith(x, ids, w, 0), rtol=1e-5, atol=1e-6)
        assert not c.evicted and c.failovers >= 1
        metrics = httpx.get(f"{servers[0].url}/metrics", timeout=10).text
        assert 'status="stale_map"}' in metrics, metrics
    finally:
        c.close()


@pytest.fixture
def servers_without_grace(monkeypatch):
    """The three servers of HOSTED in this process, with a drop grace no test run reaches: a
    drop can then only be released by the clients' acks."""
    monkeypatch.setattr(server_placement, "DROP_GRACE_S", NO_GRACE_S)
    experts = SPEC.experts()
    running = []
    try:
        for i, hosted in enumerate(HOSTED):
            s = ExpertServer(
                {la: {e: experts[la][e] for e in ids} for la, ids in hosted.items()}, f"g{i}"
            )
            s.start()
            http = HttpServer(make_app(s, TOKEN))
            running.append((s, http, http.start()))
        yield [url for _, _, url in running]
    finally:
        for s, http, _ in running:
            http.stop()
            s.close()


@pytest.mark.timeout(180)
def test_drop_waits_for_every_client_to_stop_routing(servers_without_grace):
    """Two busy clients: the drop lands only after both have fetched the new table, and neither
    ever sees STALE_MAP (no failover). With the idle grace out of reach, the drop landing at all
    shows that the busy clients' acks released it."""
    servers = servers_without_grace
    clients = [make_client(servers) for _ in range(2)]
    stop, errors = threading.Event(), []

    def drive(c, seed):
        g = torch.Generator().manual_seed(seed)
        step = 0
        while not stop.is_set():
            x, ids, w = skewed_batch(g, step, 1000)
            try:
                y = c.combine(c.dispatch(x, ids, w, 0))
                torch.testing.assert_close(y, monolith(x, ids, w, 0), rtol=1e-5, atol=1e-6)
            except Exception as exc:  # reported below
                errors.append(exc)
                return
            step += 1

    threads = [threading.Thread(target=drive, args=(c, i)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        r = httpx.post(
            f"{servers[1]}/experts/unload", json={"layer": 0, "expert": 4, "token": TOKEN}
        )
        assert r.status_code == 200
        deadline = time.monotonic() + DROP_DEADLINE_S
        while tables(servers)[1]["leaving"]:
            assert time.monotonic() < deadline, "the drop was never released by the clients' acks"
            time.sleep(0.02)
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for c in clients:
            c.close()
    assert not errors, errors
    assert all(c.failovers == 0 for c in clients)


def test_retired_and_unknown_indices_are_told_apart_in_process():
    """A retired index is STALE_MAP, an index past the table UNKNOWN_EXPERT; an added expert
    is served at a new index and the health check uses a live one."""
    experts = SPEC.experts()[0]
    server = ExpertServer({0: {e: experts[e] for e in (0, 1, 2)}}, "inproc")
    layout = SlotLayout(8, SPEC.hidden, 1, "f32", "f32")
    ch = ClientChannel(server.transport, layout, 5, 1)
    try:
        info = server.connect(5, ch.handle, layout, 1)
        ch.connect(info["server_handle"], info["doorbell_handle"])
        server.unload_expert(0, 0)
        deadline = time.monotonic() + 10
        while server.placement.leaving:  # the client never fetches: the idle grace applies
            assert time.monotonic() < deadline
            server.step(0.05)
        server.load_expert(0, 7, experts[7])
        assert server.hosted() == {0: [-1, 1, 2, 7]}
        assert server.health_check()["ok"] and server.health_check()["expert"] == 1
        x = torch.randn(2, SPEC.hidden)
        for local, status in ((0, ResponseStatus.STALE_MAP), (9, ResponseStatus.UNKNOWN_EXPERT)):
            seq = ch.send(0, x, torch.full((2, 1), local, dtype=torch.int32), torch.ones(2, 1))
            server.step(0.05)
            with pytest.raises(RemoteError) as info:
                ch.wait(0, seq, 5.0)
            assert info.value.status == int(status)
            ch.release(0)
        seq = ch.send(0, x, torch.full((2, 1), 3, dtype=torch.int32), torch.ones(2, 1))
        server.step(0.05)
        y = ch.wait(0, seq, 5.0).activations.clone()
        ids = torch.full((2, 1), 7, dtype=torch.int32)
        assert torch.equal(y, monolith(x, ids, torch.ones(2, 1), 0))
    finally:
        ch.close()
        server.close()


def test_a_client_that_leaves_takes_its_ack_along():
    """A client acks the table at connect and again on a fetch; when it disconnects, or is
    dropped as dead, the server keeps no ack of it (the table of acks stays bounded)."""
    experts = SPEC.experts()[0]
    server = ExpertServer({0: {e: experts[e] for e in (0, 1)}}, "acks")
    layout = SlotLayout(8, SPEC.hidden, 1, "f32", "f32")
    channels = [ClientChannel(server.transport, layout, cid, 1) for cid in (5, 6)]
    try:
        for cid, ch in zip((5, 6), channels, strict=True):
            info = server.connect(cid, ch.handle, layout, 1)
            ch.connect(info["server_handle"], info["doorbell_handle"])
        server.unload_expert(0, 0)
        server.placement.describe(5)  # a client fetching the new table acks its epoch
        assert set(server.placement._acks) == {5, 6}
        assert server.disconnect(5)
        assert set(server.placement._acks) == {6}
        # The dead-client path: the registry drops client 6 as if its process had died.
        server.clients.drop_dead = lambda: [6] if server.clients.remove(6) else []
        server._drop_dead_clients()
        assert server.placement._acks == {}
    finally:
        for ch in channels:
            ch.close()
        server.close()


@pytest.mark.timeout(180)
def test_experts_of_a_lost_server_get_new_homes():
    """Experts 6-11 live only on a server that is killed: the next pass loads them on the
    survivor from its checkpoint, and a client routes to them again without losing a request."""
    procs = [
        spawn_expert_server(SPEC, {0: list(range(6))}, "h0", TOKEN),
        spawn_expert_server(SPEC, {0: list(range(6, 12))}, "h1", TOKEN),
    ]
    c = None
    try:
        urls = [p.url for p in procs]
        controller = PlacementController(urls, TOKEN, min_tokens=0, min_gain=0.0)
        assert controller.rebalance().skipped  # both alive and idle: nothing to do
        c = make_client(procs)
        procs[1].process.kill()
        procs[1].process.join(10)
        report = controller.rebalance()
        assert report.servers == 1 and report.replicas_loaded == 6, report
        assert report.sources == {"checkpoint": 6} and not report.errors
        g = torch.Generator().manual_seed(3)
        for _ in range(4):  # some dispatches pick the dead replica first: re-sent, not lost
            x = torch.randn(8, SPEC.hidden, generator=g)
            ids = torch.randint(0, 12, (8, TOPK), generator=g).to(torch.int32)
            w = torch.rand(8, TOPK, generator=g)
            y = c.combine(c.dispatch(x, ids, w, 0))
            torch.testing.assert_close(y, monolith(x, ids, w, 0), rtol=1e-5, atol=1e-6)
    finally:
        if c is not None:
            c.close()
        for p in procs:
            p.stop()


def test_round_robin_rotates_replicas_per_layer_when_layers_interleave():
    """A model calls its layers in turn: with two layers and two replicas, a counter shared by
    the layers would send every layer-0 token to one replica and every layer-1 token to the
    other."""
    experts = SPEC.experts()
    servers, https = [], []
    c = None
    try:
        for name in ("rr0", "rr1"):
            s = ExpertServer({la: {e: experts[la][e] for e in range(4)} for la in (0, 1)}, name)
            s.start()
            https.append(HttpServer(make_app(s)))
            servers.append((s, https[-1].start()))
        c = connect_client([u for _, u in servers], SPEC.hidden, 1, 8)
        x, ids, w = (
            torch.ones(2, SPEC.hidden),
            torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, 1),
        )
        used = {0: [], 1: []}  # layer -> the server each dispatch of it went to
        for step in range(8):
            h = c.dispatch(x, ids, w, step % 2)
            used[step % 2] += [s.server for s in h.sent]
            c.combine(h)
        assert sorted(used[0]) == sorted(used[1]) == [0, 0, 1, 1]
    finally:
        if c is not None:
            c.close()
        for (s, _), h in zip(servers, https, strict=True):
            h.stop()
            s.close()
