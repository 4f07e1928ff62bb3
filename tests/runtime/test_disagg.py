"""The EaaS runtime through real processes: expert servers with HTTP control planes on
127.0.0.1, attention clients here, compared with the in-process layer of the same weights."""

import os
import signal
import time

import httpx
import moecomm
import pytest
import torch
from moecomm.ops.dispatch import pack_dispatch
from moecomm.runtime.experts import LayerExperts
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.testing.clients import connect_client
from proc_helpers import stop_process

SPEC = ModelSpec(num_layers=2, num_experts=8, hidden=64, intermediate=32, seed=3)
TOKEN = "s3cret"
TOPK = 3


@pytest.fixture(scope="module")
def two_servers():
    """Experts 0-3 on s0 and 4-7 on s1 (no replicas), both layers."""
    servers = []
    try:
        servers.append(spawn_expert_server(SPEC, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, "s0", TOKEN))
        servers.append(spawn_expert_server(SPEC, {0: [4, 5, 6, 7], 1: [4, 5, 6, 7]}, "s1", TOKEN))
        yield servers
    finally:
        for s in servers:
            s.stop()


def routed_batch(n, seed, topk=TOPK, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, SPEC.hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(SPEC.num_experts, generator=g)[:topk] for _ in range(n)])
    w = torch.rand(n, topk, generator=g)
    return x, ids.to(torch.int32), w


def grouped_reference(x, ids, w, layer, expert_map, replica=None):
    """The monolith with the runtime's summation order: per server (in server order) the sum over
    its experts in k order, then the servers' partials summed in server order."""
    experts = SPEC.experts()[layer]
    y = torch.zeros(x.shape, dtype=torch.float32)
    for b in pack_dispatch(x, ids, w, expert_map, replica=replica):
        hosted = sorted(
            {
                e
                for e in range(SPEC.num_experts)
                if any(s == b.server for s, _ in expert_map.replicas(e))
            }
        )
        server_layer = LayerExperts(layer, {e: experts[e] for e in hosted})
        (part,) = server_layer.forward([b.activations], [b.expert_ids], [b.scores])
        y[b.token_index] += part.float()
    return y


def naive_monolith(x, ids, w, layer):
    experts = SPEC.experts()[layer]
    full = LayerExperts(layer, experts)
    (y,) = full.forward([x], [ids], [w])
    return y.float()


def client(servers, cid, **kw):
    return connect_client(
        servers, SPEC.hidden, TOPK, 64, cid, **{"token": TOKEN, "timeout": 20.0, **kw}
    )


@pytest.mark.timeout(300)
def test_one_client_two_servers_bit_exact_against_the_monolith(two_servers):
    c = client(two_servers, 1)
    try:
        for layer in (0, 1):
            for n, seed in ((1, 0), (7, 1), (64, 2)):
                x, ids, w = routed_batch(n, seed + 10 * layer)
                y = c.combine(c.dispatch(x, ids, w, layer))
                want = grouped_reference(x, ids, w, layer, c.maps[layer])
                assert torch.equal(y, want), f"layer {layer} n {n}"
                torch.testing.assert_close(
                    y, naive_monolith(x, ids, w, layer), rtol=1e-5, atol=1e-6
                )
    finally:
        c.close()


@pytest.mark.timeout(300)
def test_double_batch_overlap_two_micro_batches_in_flight(two_servers):
    c = client(two_servers, 2)
    try:
        a, b = routed_batch(5, 100), routed_batch(9, 101)
        ha = c.dispatch(*a, layer_id=0)
        hb = c.dispatch(*b, layer_id=0)  # both in flight, on slots 0 and 1
        assert {ha.slot, hb.slot} == {0, 1}
        with pytest.raises(RuntimeError, match="in flight"):
            c.dispatch(*a, layer_id=0)
        yb, ya = c.combine(hb), c.combine(ha)
        torch.testing.assert_close(ya, naive_monolith(*a, 0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(yb, naive_monolith(*b, 0), rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="already combined"):
            c.combine(ha)
    finally:
        c.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("encoding", "tol"), [("int8", 0.03), ("fp8_e4m3", 0.1)])
def test_quantized_dispatch_within_tolerance(two_servers, encoding, tol):
    c = client(two_servers, 3, encoding=encoding)
    try:
        x, ids, w = routed_batch(16, 7)
        y = c.combine(c.dispatch(x, ids, w, 1))
        ref = naive_monolith(x, ids, w, 1)
        rel = (y - ref).norm() / ref.norm()
        assert rel < tol, f"{encoding}: relative error {rel:.4f}"
    finally:
        c.close()


def test_control_plane_endpoints(two_servers):
    s0 = two_servers[0]
    h = httpx.get(f"{s0.url}/health", timeout=10).json()
    assert h["ok"] and h["server_id"] == "s0" and h["forward_ms"] > 0
    e = httpx.get(f"{s0.url}/experts", timeout=10).json()
    assert e["layers"] == {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]} and e["hidden"] == SPEC.hidden
    m = httpx.get(f"{s0.url}/metrics", timeout=10).text
    assert 'moecomm_server_requests_total{server="s0"}' in m
    assert "# TYPE moecomm_server_clients gauge" in m


def test_connect_is_authenticated_and_validated(two_servers, transport):
    url = two_servers[0].url
    region = transport.create_region(4096)
    body = {
        "client_id": 9,
        "client_handle": region.handle,
        "num_slots": 2,
        "token": "wrong",
        "layout": {
            "max_tokens": 4,
            "hidden": SPEC.hidden,
            "topk": 2,
            "encoding": "f32",
            "out_encoding": "f32",
        },
    }
    assert httpx.post(f"{url}/connect", json=body, timeout=10).status_code == 401
    body["token"] = TOKEN
    for field, value in (("max_tokens", 0), ("max_tokens", 1 << 40), ("topk", 1000)):
        bad = {**body, "layout": {**body["layout"], field: value}}
        assert httpx.post(f"{url}/connect", json=bad, timeout=10).status_code == 422
    bad = {**body, "layout": {**body["layout"], "hidden": SPEC.hidden + 1}}
    r = httpx.post(f"{url}/connect", json=bad, timeout=10)
    assert r.status_code == 400 and "hidden" in r.text
    gone = {**body, "client_handle": "shm:moecomm-1-1-1-dead"}
    assert httpx.post(f"{url}/connect", json=gone, timeout=10).status_code == 404
    r = httpx.post(f"{url}/connect", content=b"{not json", timeout=10)
    assert r.status_code == 422
    # A GPU client cannot be served from host shared memory: refused before any attach.
    r = httpx.post(f"{url}/connect", json={**body, "transport": "cuda_ipc"}, timeout=10)
    assert r.status_code == 400 and "cannot serve a 'cuda_ipc' client" in r.text
    r = httpx.post(f"{url}/connect", json={**body, "transport": "carrier-pigeon"}, timeout=10)
    assert r.status_code == 400 and "unknown transport" in r.text
    with pytest.raises(ConnectionError, match="refused"):
        client(two_servers, 10, token="nope")


@pytest.mark.timeout(300)
def test_replicas_two_clients_three_servers():
    # Every expert on two of three servers; two clients, each round-robin over replicas.
    hosted = [{0: [0, 1, 2, 3, 4, 5]}, {0: [2, 3, 4, 5, 6, 7]}, {0: [0, 1, 6, 7]}]
    servers = [spawn_expert_server(SPEC, h, f"r{i}", TOKEN) for i, h in enumerate(hosted)]
    clients = []
    try:
        clients = [
            client(servers, cid, replica_policy=p)
            for cid, p in ((21, "round_robin"), (22, "least_outstanding"))
        ]
        for step in range(4):
            handles = []
            for i, c in enumerate(clients):
                x, ids, w = routed_batch(12, 1000 + 10 * step + i)
                handles.append((c, c.dispatch(x, ids, w, 0), (x, ids, w)))
            for c, h, (x, ids, w) in handles:
                y = c.combine(h)
                want = grouped_reference(x, ids, w, 0, c.maps[0], replica=h.replica)
                assert torch.equal(y, want), f"client {c.client_id} step {step}"
        loads = [httpx.get(f"{s.url}/experts", timeout=10).json()["load"] for s in servers]
        assert all(loads), "every server received work"
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.stop()


@pytest.mark.timeout(300)
def test_stopped_server_without_replica_fails_fast_naming_server_and_experts():
    servers = [spawn_expert_server(SPEC, {0: list(range(8))}, "only", TOKEN)]
    c = None
    try:
        c = client(servers, 31, timeout=0.5)
        x, ids, w = routed_batch(4, 5)
        c.combine(c.dispatch(x, ids, w, 0))  # healthy first
        stop_process(servers[0].process.pid)
        h = c.dispatch(x, ids, w, 0)
        start = time.monotonic()
        with pytest.raises(moecomm.MoecommError, match="no live replica of expert") as info:
            c.combine(h)
        assert time.monotonic() - start < 5  # one deadline, then no retry on a dead peer
        assert servers[0].url in str(info.value) and "no response within" in str(info.value)
        with pytest.raises(moecomm.MoecommError, match="no live replica"):
            c.dispatch(x, ids, w, 0)  # evicted: refused at once, naming the experts
        with pytest.raises(ValueError, match="layer 5"):
            c.dispatch(x, ids, w, 5)
    finally:
        os.kill(servers[0].process.pid, signal.SIGCONT)
        if c is not None:
            c.close()
        servers[0].stop()


@pytest.mark.timeout(300)
def test_garbage_from_one_client_does_not_disturb_another(two_servers, transport):
    from moecomm.runtime.control import http_connect
    from moecomm.wire.client import ClientChannel
    from moecomm.wire.protocol import SlotLayout

    good = client(two_servers, 41)
    layout = SlotLayout(8, SPEC.hidden, TOPK, "f32", "f32")
    rogue = ClientChannel(transport, layout, 42, name="rogue")
    info = http_connect(two_servers[0].url, 42, rogue.handle, layout, 2, TOKEN)
    rogue.connect(info["server_handle"], info["doorbell_handle"])
    try:
        x = torch.randn(2, SPEC.hidden)
        scores = torch.ones(2, TOPK)
        # Local expert 99 does not exist on s0; layer 7 is not hosted.
        bad_ids = torch.tensor([[0, 99, -1], [1, 2, 3]], dtype=torch.int32)
        seq = rogue.send(0, x, bad_ids, scores, layer_id=0)
        with pytest.raises(moecomm.RemoteError, match="local expert 99") as info_err:
            rogue.wait(0, seq, 20)
        assert info_err.value.status == int(moecomm.wire.protocol.ResponseStatus.UNKNOWN_EXPERT)
        seq = rogue.send(1, x, torch.zeros(2, TOPK, dtype=torch.int32), scores, layer_id=7)
        with pytest.raises(moecomm.RemoteError, match="no expert of layer 7"):
            rogue.wait(1, seq, 20)
        # The well-behaved client is served throughout.
        xb, ids, w = routed_batch(6, 77)
        y = good.combine(good.dispatch(xb, ids, w, 0))
        torch.testing.assert_close(y, naive_monolith(xb, ids, w, 0), rtol=1e-5, atol=1e-6)
    finally:
        good.close()
        rogue.close()
