"""Failover with real processes: kill -9 of an expert server under load loses no request and
gives the outputs of the fault-free run, with no membership, the embedded monitor and etcd. The
trial count per backend is MOECOMM_FAILOVER_TRIALS (CI: 2;
20 for a long run)."""

import os
import signal

import httpx
import pytest
import torch
from long_run import LONG
from membership_procs import MONITOR_TOKEN
from moecomm.membership import connect_membership
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.testing.clients import connect_client

SPEC = ModelSpec(num_layers=2, num_experts=6, hidden=48, intermediate=24, seed=11)
TTL = 1.0
TRIALS = int(os.environ.get("MOECOMM_FAILOVER_TRIALS", "20" if LONG else "2"))
STEPS = 6
TOPK = 2
# Every expert on two of three servers.
HOSTED = [
    {
        layer: [e for e in range(SPEC.num_experts) if s in (e % 3, (e + 1) % 3)]
        for layer in range(SPEC.num_layers)
    }
    for s in range(3)
]


def batches():
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(STEPS):
        n = 3 + step
        x = torch.randn(n, SPEC.hidden, generator=g)
        ids = torch.stack(
            [torch.randperm(SPEC.num_experts, generator=g)[:TOPK] for _ in range(n)]
        ).to(torch.int32)
        out.append((x, ids, torch.rand(n, TOPK, generator=g), step % SPEC.num_layers))
    return out


def run(servers, cid, kill_at=None, victim=None, membership=None):
    c = connect_client(servers, SPEC.hidden, TOPK, 16, cid, timeout=2.0)
    if membership is not None:
        c.follow(membership, TTL)
    ys = []
    try:
        for step, (x, ids, w, layer) in enumerate(batches()):
            h = c.dispatch(x, ids, w, layer)
            if step == kill_at:
                os.kill(victim.process.pid, signal.SIGKILL)
                victim.process.join(10)
            ys.append(c.combine(h))
        return ys, c.failovers
    finally:
        c.close()


@pytest.fixture(params=["none", "embedded", "etcd"])
def membership(request):
    """Where losses are heard from besides deadlines and process liveness."""
    if request.param == "none":
        return None, "", ""
    if request.param == "embedded":
        mon = request.getfixturevalue("monitor_process")
        return connect_membership(mon.url, MONITOR_TOKEN), mon.url, MONITOR_TOKEN
    etcd = request.getfixturevalue("etcd_process")
    url = f"etcd://{etcd.endpoint}/moecomm-failover-{os.getpid()}"
    return connect_membership(url), url, ""


@pytest.mark.timeout(900)
def test_kill_9_of_a_server_under_load_loses_nothing(membership):
    ms, url, token = membership
    for trial in range(TRIALS):
        servers = [
            spawn_expert_server(
                SPEC, h, f"t{trial}s{i}", monitor_url=url or None, ttl=TTL, monitor_token=token
            )
            for i, h in enumerate(HOSTED)
        ]
        try:
            clean, failovers = run(servers, 100 + trial)
            assert failovers == 0
            victim = servers[trial % 3]
            faulty, failovers = run(
                servers, 200 + trial, kill_at=trial % STEPS, victim=victim, membership=ms
            )
            assert failovers >= 1 or ms is not None, "the kill was not noticed"
            assert len(faulty) == STEPS  # zero requests lost
            for step, (a, b) in enumerate(zip(clean, faulty, strict=True)):
                assert torch.equal(b, a), f"trial {trial} step {step}: {(b - a).abs().max()}"
        finally:
            for s in servers:
                s.stop()


@pytest.mark.timeout(300)
def test_graceful_drain_and_elastic_join_without_restart():
    servers = [spawn_expert_server(SPEC, h, f"d{i}") for i, h in enumerate(HOSTED[:2])]
    try:
        # Servers 0 and 1 hold every expert except those only on the third server's share:
        # start with all three, drain one, then let a fresh server join in its place.
        servers.append(spawn_expert_server(SPEC, HOSTED[2], "d2"))
        clean, _ = run(servers, 300)
        c = connect_client(servers, SPEC.hidden, TOPK, 16, 301, timeout=5.0)
        try:
            got = []
            for step, (x, ids, w, layer) in enumerate(batches()):
                if step == 2:
                    r = httpx.post(f"{servers[1].url}/drain", json={"token": ""}, timeout=10)
                    assert r.status_code == 200
                    assert httpx.get(f"{servers[1].url}/health", timeout=10).json()["draining"]
                if step == 4:
                    joined = spawn_expert_server(SPEC, HOSTED[1], "d1-new")
                    servers.append(joined)
                    c.remove_server(servers[1].url)
                    assert c.add_server(joined.url) == 3
                got.append(c.combine(c.dispatch(x, ids, w, layer)))
            for step, (a, b) in enumerate(zip(clean, got, strict=True)):
                assert torch.equal(a, b), f"step {step}"
            loads = httpx.get(f"{servers[3].url}/experts", timeout=10).json()["load"]
            assert loads, "the joined server received work"
            refused = httpx.post(
                f"{servers[1].url}/connect",
                timeout=10,
                json={
                    "client_id": 999,
                    "client_handle": c.channels[0].handle,
                    "num_slots": 1,
                    "layout": c.layout.to_dict(),
                },
            )
            assert refused.status_code == 400 and "draining" in refused.text
        finally:
            c.close()
    finally:
        for s in servers:
            s.stop()
