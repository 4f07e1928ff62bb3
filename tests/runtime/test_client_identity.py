"""Client identity that cannot be taken over: a connect never hands one live client's slots to
another. Ids are random by default; a reconnect proves it is the same client with the session
secret the server issued; a clash is refused with a clear error; a client whose session was lost
reconnects on its own and says so in its log."""

import logging
import subprocess

import httpx
import pytest
import torch
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.runtime.registry import ClientIdInUseError
from moecomm.testing import FrontendSpec, connect_client, start_local_cluster

SPEC = ModelSpec(num_layers=1, num_experts=4, hidden=32, intermediate=16, seed=2)
TOPK = 2
# The refused second front end: imports torch and loads the checkpoint first, on a loaded
# machine.
START_S = 120.0


@pytest.fixture(scope="module")
def servers():
    """Every expert on both servers: a client that loses one keeps being served."""
    started = []
    try:
        for i in range(2):
            started.append(spawn_expert_server(SPEC, {0: list(range(4))}, f"id{i}"))
        yield started
    finally:
        for s in started:
            s.stop()


def client(servers, client_id, **kw):
    return connect_client(servers, SPEC.hidden, TOPK, 8, client_id, timeout=5.0, **kw)


def step(c, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, SPEC.hidden, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:TOPK] for _ in range(4)]).int()
    return c.combine(c.dispatch(x, ids, torch.rand(4, TOPK, generator=g), 0))


@pytest.mark.timeout(120)
def test_a_second_live_client_with_the_same_id_is_refused_and_the_first_keeps_its_slots(servers):
    first = client(servers, 7)
    try:
        want = step(first)
        with pytest.raises(ClientIdInUseError, match="client id 7 belongs to another live client"):
            client(servers, 7)
        assert torch.equal(step(first), want)
        assert first.failovers == 0
    finally:
        first.close()
    again = client(servers, 7)  # the id is free once its holder disconnected
    again.close()


@pytest.mark.timeout(120)
def test_default_client_ids_are_random_not_the_pid(servers):
    a, b = client(servers, None), client(servers, None)
    try:
        assert a.client_id != b.client_id
        assert torch.equal(step(a), step(b))
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(120)
def test_a_disconnect_needs_the_current_session(servers):
    c = client(servers, 11)
    try:
        r = httpx.post(
            f"{servers[0].url}/disconnect",
            json={"client_id": 11, "session": "0" * 32},
            timeout=10,
        )
        assert r.status_code == 409
        assert torch.equal(step(c), step(c))
        assert c.failovers == 0
    finally:
        c.close()


@pytest.mark.timeout(120)
def test_a_client_whose_session_was_dropped_reconnects_on_its_own_and_logs_it(servers, caplog):
    c = client(servers, 12)
    try:
        want = step(c)
        # An operator (or a lapsed lease) drops the live client at one server.
        r = httpx.post(f"{servers[0].url}/disconnect", json={"client_id": 12}, timeout=10)
        assert r.json() == {"disconnected": True}
        with caplog.at_level(logging.WARNING, logger="moecomm.client"):
            got = [step(c) for _ in range(3)]
        assert all(torch.equal(g, want) for g in got)
        assert c.reconnects == 1
        assert any("reconnected" in rec.getMessage() for rec in caplog.records)
        assert not c.evicted, "a server that took the reconnect is healthy"
    finally:
        c.close()


@pytest.mark.timeout(300)
def test_two_front_ends_with_the_same_client_id(tmp_path, tiny_mixtral_dir):
    """The second `moecomm frontend --client-id 7` stops with a clear error; the first one keeps
    answering completions."""
    with start_local_cluster(
        tiny_mixtral_dir, servers=["all"], frontends=[FrontendSpec(args=("--client-id", "7"))]
    ) as cluster:
        first = cluster.frontends[0]
        second = subprocess.run(first.argv, capture_output=True, text=True, timeout=START_S)
        assert second.returncode != 0
        assert "client id 7 belongs to another live client" in second.stderr
        assert "Traceback" not in second.stderr
        r = httpx.post(
            f"{first.url}/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
