"""Hung peers with real processes: a SIGSTOPped server is failed over at the deadline and, once
resumed, is routed to again only after its health probe passes; a client stopped or killed in
the middle of its traffic never blocks a server, which drops it under load."""

import os
import signal
import time

import httpx
import pytest
import torch
from moecomm import prefork
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.testing.clients import connect_client
from proc_helpers import stop_process

SPEC = ModelSpec(num_layers=1, num_experts=4, hidden=32, intermediate=16, seed=9)
TOPK = 2
DEADLINE_S = 1.0
EVICT_S = 0.5
ALL = {0: list(range(SPEC.num_experts))}


def client(urls, client_id=None, timeout=DEADLINE_S):
    return connect_client(urls, SPEC.hidden, TOPK, 8, client_id, timeout=timeout, evict_s=EVICT_S)


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    n = 1 + seed % 8
    ids = torch.stack([torch.randperm(SPEC.num_experts, generator=g)[:TOPK] for _ in range(n)])
    return torch.randn(n, SPEC.hidden, generator=g), ids.int(), torch.rand(n, TOPK, generator=g)


def served_tokens(url):
    return sum(e["tokens"] for e in httpx.get(f"{url}/experts", timeout=10).json()["load"])


@pytest.mark.timeout(180)
def test_a_stopped_server_is_failed_over_and_rejoins_only_once_healthy(reaper):
    servers = [reaper.server(spawn_expert_server(SPEC, ALL, f"hung{i}")) for i in range(2)]
    want = {}
    c = client([s.url for s in servers])
    try:
        for seed in range(8):
            want[seed] = c.combine(c.dispatch(*batch(seed), 0))
        stop_process(servers[0].process.pid)
        start = time.monotonic()
        for seed in range(8):
            assert torch.equal(c.combine(c.dispatch(*batch(seed), 0)), want[seed])
        assert c.failovers >= 1 and 0 in c.evicted
        assert time.monotonic() - start < 8 * DEADLINE_S, "more than one deadline per failover"
        # Stopped: its eviction time passes but its /health does not answer, so it stays out.
        time.sleep(EVICT_S * 2)
        c.combine(c.dispatch(*batch(0), 0))
        time.sleep(EVICT_S)
        c.combine(c.dispatch(*batch(1), 0))
        assert 0 in c.evicted
        os.kill(servers[0].process.pid, signal.SIGCONT)
        before = served_tokens(servers[0].url)
        deadline = time.monotonic() + 30
        seed = 0
        while served_tokens(servers[0].url) == before:
            assert time.monotonic() < deadline, "the resumed, healthy server never rejoined"
            assert torch.equal(c.combine(c.dispatch(*batch(seed % 8), 0)), want[seed % 8])
            seed += 1
            time.sleep(0.05)
        assert 0 not in c.evicted
    finally:
        c.close()


def _busy_client(urls, ready):
    c = client(urls, timeout=30.0)
    ready.set()
    seed = 0
    while True:  # until stopped and killed by the test
        c.combine(c.dispatch(*batch(seed % 8), 0))
        seed += 1


@pytest.mark.timeout(180)
def test_a_stopped_then_killed_client_never_blocks_the_server(reaper):
    server = reaper.server(spawn_expert_server(SPEC, ALL, "busy"))
    ctx = prefork.process_context()
    ready = ctx.Event()
    other = reaper.process(ctx.Process(target=_busy_client, args=([server.url], ready)))
    other.start()
    assert ready.wait(60)
    time.sleep(0.2)
    stop_process(other.pid)  # stopped at a random point of its traffic
    c = client([server.url])
    try:
        for seed in range(20):
            start = time.monotonic()
            c.combine(c.dispatch(*batch(seed), 0))
            assert time.monotonic() - start < DEADLINE_S
        assert httpx.get(f"{server.url}/health", timeout=10).json()["clients"] == 2
        os.kill(other.pid, signal.SIGKILL)
        other.join(10)
        # Under continuous load (no idle wake), the dead client is still dropped.
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health", timeout=10).json()["clients"] != 1:
            assert time.monotonic() < deadline, "the dead client was never dropped"
            c.combine(c.dispatch(*batch(0), 0))
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'moecomm_server_dead_clients_dropped_total{server="busy"} 1' in metrics
        assert 'moecomm_server_loop_failed{server="busy"} 0' in metrics
    finally:
        c.close()


@pytest.mark.timeout(180)
def test_a_client_starts_while_a_replica_is_stopped_and_takes_it_in_once_it_answers(reaper):
    servers = [reaper.server(spawn_expert_server(SPEC, ALL, f"late{i}")) for i in range(2)]
    stop_process(servers[1].process.pid)
    c = client([s.url for s in servers])  # the stopped one cannot answer its connect
    try:
        assert c.channels[1] is None and 1 in c.evicted
        want = [c.combine(c.dispatch(*batch(seed), 0)) for seed in range(4)]
        os.kill(servers[1].process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        seed = 0
        while served_tokens(servers[1].url) == 0:
            assert time.monotonic() < deadline, "the server that came back was never connected"
            assert torch.equal(c.combine(c.dispatch(*batch(seed % 4), 0)), want[seed % 4])
            seed += 1
            time.sleep(0.05)
        assert c.channels[1] is not None and not c.evicted
    finally:
        c.close()


@pytest.mark.timeout(120)
def test_a_refused_connect_is_an_error_not_a_server_left_out(reaper):
    server = reaper.server(spawn_expert_server(SPEC, ALL, "auth", token="right"))
    with pytest.raises(ConnectionError, match="refused"):
        client([server.url])


@pytest.mark.timeout(120)
def test_close_does_not_wait_long_on_a_stopped_server(reaper):
    servers = [reaper.server(spawn_expert_server(SPEC, ALL, f"close{i}")) for i in range(2)]
    c = client([s.url for s in servers])
    stop_process(servers[0].process.pid)
    start = time.monotonic()
    c.close()
    assert time.monotonic() - start < 2 * DEADLINE_S
    os.kill(servers[0].process.pid, signal.SIGCONT)
