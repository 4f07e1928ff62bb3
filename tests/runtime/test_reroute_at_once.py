"""A dead server's share is re-sent the moment its death is seen, while the step's other
servers still owe their answers: real expert server processes over shm.

Server A is held by SIGSTOP (its answer cannot come), server D is stopped before the dispatch
and killed after it;
every expert of D has a replica on R. The re-sent share must be served by R while A is still
held — the old combine waited for A first, and re-sent only once every server had answered or
failed (MOECOMM_RESEND=after_step keeps that behaviour; the last test pins it)."""

import os
import signal
import threading
import time

import httpx
import pytest
import torch
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.testing.clients import connect_client
from proc_helpers import stop_process

SPEC = ModelSpec(num_layers=1, num_experts=4, hidden=32, intermediate=16, seed=7)
TOPK = 2
# Server order A, D, R: experts 0-1 on A only, 2-3 on D and on R (D first: the replica the
# least-outstanding policy picks on a tie).
HOSTED = [{0: [0, 1]}, {0: [2, 3]}, {0: [2, 3]}]
A, D, R = 0, 1, 2
# Far beyond the test: A's held answer must not be failed over by its deadline.
CLIENT_TIMEOUT_S = 120.0
# How long R may take to serve the re-sent share on a loaded machine (A stays held meanwhile).
RESEND_BOUND_S = 30.0
# How long the after_step comparison watches R stay idle: its combine cannot get past A.
IDLE_WATCH_S = 3.0


def _batch():
    x = torch.randn(4, SPEC.hidden, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[0, 2], [1, 3], [0, 3], [1, 2]], dtype=torch.int32)
    w = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5], [0.9, 0.1]])
    return x, ids, w


def _tokens_served(url: str) -> int:
    load = httpx.get(f"{url}/experts", timeout=10).json()["load"]
    return sum(row["tokens"] for row in load)


def _client(servers, client_id, resend=None):
    return connect_client(
        servers,
        SPEC.hidden,
        TOPK,
        8,
        client_id,
        timeout=CLIENT_TIMEOUT_S,
        replica_policy="least_outstanding",
        resend=resend,
    )


class Combine(threading.Thread):
    def __init__(self, client, handle):
        super().__init__(daemon=True)
        self.client, self.handle = client, handle
        self.y = self.error = None

    def run(self):
        try:
            self.y = self.client.combine(self.handle)
        except Exception as exc:  # reported by the test
            self.error = exc


def _held_step(reaper, resend, watch_s=RESEND_BOUND_S):
    """Runs the scenario; returns (served by R while A was held, combine thread, clean result,
    client, servers). A is resumed by the caller's finally (via the returned servers)."""
    servers = [reaper.server(spawn_expert_server(SPEC, h, f"r{i}")) for i, h in enumerate(HOSTED)]
    c = _client(servers, 41, resend)
    x, ids, w = _batch()
    clean = c.combine(c.dispatch(x, ids, w, 0))  # every server up
    before = _tokens_served(servers[R].url)
    stop_process(servers[A].process.pid)
    # D is stopped before the dispatch and killed after it: its share is lost for certain (a
    # running D could answer between the dispatch and the kill, leaving nothing to re-send).
    stop_process(servers[D].process.pid)
    h = c.dispatch(x, ids, w, 0)
    assert sorted(s.server for s in h.sent) == [A, D], "precondition: the step uses A and D"
    os.kill(servers[D].process.pid, signal.SIGKILL)
    combine = Combine(c, h)
    combine.start()
    deadline = time.monotonic() + watch_s
    served = False
    while time.monotonic() < deadline and not served:
        served = _tokens_served(servers[R].url) > before
        time.sleep(0.05)
    return served, combine, clean, c, servers


@pytest.mark.timeout(300)
def test_the_dead_servers_share_is_served_by_its_replica_before_the_other_answers(reaper):
    servers = c = None
    try:
        served, combine, clean, c, servers = _held_step(reaper, None)
        assert combine.is_alive(), "combine returned while A was held"
        assert served, f"R served nothing within {RESEND_BOUND_S} s while A was held"
        assert c.failovers == 1
        assert D in c.evicted
        os.kill(servers[A].process.pid, signal.SIGCONT)
        combine.join(60)
        assert not combine.is_alive() and combine.error is None, combine.error
        assert torch.equal(combine.y, clean)  # two terms per token: any order, same bits
    finally:
        if servers is not None:
            os.kill(servers[A].process.pid, signal.SIGCONT)
        if c is not None:
            c.close()


@pytest.mark.timeout(300)
def test_after_step_resend_waits_for_the_held_server(reaper):
    """The comparison path (MOECOMM_RESEND=after_step): nothing is re-sent while A is held."""
    servers = c = None
    try:
        served, combine, clean, c, servers = _held_step(reaper, "after_step", IDLE_WATCH_S)
        assert not served and c.failovers == 0 and combine.is_alive()
        os.kill(servers[A].process.pid, signal.SIGCONT)
        combine.join(60)
        assert combine.error is None, combine.error
        assert torch.equal(combine.y, clean)
        assert c.failovers == 1
    finally:
        if servers is not None:
            os.kill(servers[A].process.pid, signal.SIGCONT)
        if c is not None:
            c.close()
