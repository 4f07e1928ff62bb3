"""The runtime following a membership (embedded monitor): lost clients are freed, lost servers
are dropped before any deadline, new servers join without a restart."""

import os
import signal
import time

import httpx
import pytest
import torch
from moecomm import prefork
from moecomm.membership import MonitorServer, connect_membership
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.testing.clients import connect_client
from proc_helpers import stop_process

SPEC = ModelSpec(num_layers=1, num_experts=4, hidden=32, intermediate=16, seed=2)
TTL = 1.0
# A loss is heard within one TTL plus the monitor's expiry check; allow scheduling slack too.
HEARD_WITHIN_S = TTL + 2.0
TOPK = 2


@pytest.fixture
def monitor():
    m = MonitorServer("127.0.0.1", 0, "")
    url = m.start()
    yield url
    m.stop()


def batch(seed, n=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, SPEC.hidden, generator=g)
    ids = torch.stack([torch.randperm(SPEC.num_experts, generator=g)[:TOPK] for _ in range(n)])
    return x, ids.to(torch.int32), torch.rand(n, TOPK, generator=g)


def make_client(urls, cid, timeout):
    return connect_client(urls, SPEC.hidden, TOPK, 16, cid, timeout=timeout)


def _client_process(conn, url, monitor_url):
    c = make_client([url], 77, 10.0)
    c.follow(connect_membership(monitor_url), TTL)
    x, ids, w = batch(0)
    c.combine(c.dispatch(x, ids, w, 0))
    conn.send("ready")
    time.sleep(600)


def clients_of(url):
    return httpx.get(f"{url}/health", timeout=10).json()["clients"]


@pytest.mark.timeout(180)
def test_client_lost_per_monitor_frees_its_slots_within_a_ttl(monitor, reaper):
    server = spawn_expert_server(SPEC, {0: list(range(4))}, "m0", monitor_url=monitor, ttl=TTL)
    try:
        ctx = prefork.process_context()
        parent, child = ctx.Pipe()
        p = reaper.process(
            ctx.Process(target=_client_process, args=(child, server.url, monitor), daemon=True)
        )
        p.start()
        assert parent.poll(120) and parent.recv() == "ready"
        assert clients_of(server.url) == 1
        # Stopped, not dead: process liveness still says alive, only the lease runs out.
        stop_process(p.pid)
        start = time.monotonic()
        while clients_of(server.url) and time.monotonic() - start < HEARD_WITHIN_S + 5:
            time.sleep(0.05)
        assert clients_of(server.url) == 0
        assert time.monotonic() - start < HEARD_WITHIN_S
        os.kill(p.pid, signal.SIGCONT)
    finally:
        server.stop()


@pytest.mark.timeout(180)
def test_server_lost_per_monitor_is_dropped_before_the_deadline(monitor):
    hosted = {0: list(range(4))}
    servers = [
        spawn_expert_server(SPEC, hosted, f"n{i}", monitor_url=monitor, ttl=TTL) for i in range(2)
    ]
    c = None
    try:
        x, ids, w = batch(3)
        c = make_client([s.url for s in servers], 5, timeout=60.0)
        want = c.combine(c.dispatch(x, ids, w, 0))
        c.follow(connect_membership(monitor), TTL)
        stop_process(servers[0].process.pid)  # alive but silent: only the monitor can tell
        start = time.monotonic()
        got = [c.combine(c.dispatch(x, ids, w, 0)) for _ in range(3)]
        assert time.monotonic() - start < HEARD_WITHIN_S + 1.0  # far below the 60 s deadline
        assert all(torch.equal(g, want) for g in got)
        assert c.channels[0] is None  # dropped on the monitor's word
    finally:
        os.kill(servers[0].process.pid, signal.SIGCONT)
        if c is not None:
            c.close()
        for s in servers:
            s.stop()


@pytest.mark.timeout(180)
def test_new_server_joins_through_the_monitor_without_restart(monitor):
    first = spawn_expert_server(SPEC, {0: [0, 1, 2, 3]}, "j0", monitor_url=monitor, ttl=TTL)
    servers = [first]
    c = None
    try:
        c = make_client([first.url], 6, timeout=10.0)
        c.follow(connect_membership(monitor), TTL)
        servers.append(
            spawn_expert_server(SPEC, {0: [0, 1, 2, 3]}, "j1", monitor_url=monitor, ttl=TTL)
        )
        x, ids, w = batch(4)
        deadline = time.monotonic() + 10
        while len([ch for ch in c.channels if ch is not None]) < 2:
            assert time.monotonic() < deadline, "the join was not seen"
            c.combine(c.dispatch(x, ids, w, 0))
            time.sleep(0.05)
        for _ in range(4):  # round robin now reaches the newcomer
            c.combine(c.dispatch(x, ids, w, 0))
        load = httpx.get(f"{servers[1].url}/experts", timeout=10).json()["load"]
        assert load, "the joined server received work"
    finally:
        if c is not None:
            c.close()
        for s in servers:
            s.stop()
