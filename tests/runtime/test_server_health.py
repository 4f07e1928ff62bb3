"""An expert server's loop cannot die silently: a batch that fails is answered with an error
naming the cause and the loop goes on; anything that escapes the loop makes the server say so
(/health 503 with the reason, /metrics), withdraws its membership registration and tells its
clients at once, so they fail over instead of waiting for a deadline."""

import time

import httpx
import pytest
import torch
from membership_procs import MONITOR_TOKEN
from moecomm.errors import MoecommError, PeerOfflineError, RemoteError
from moecomm.membership import connect_membership
from moecomm.runtime import ExpertServer
from moecomm.runtime.control import HttpServer, make_app
from moecomm.runtime.experts import random_experts
from moecomm.wire.client import ClientChannel
from moecomm.wire.protocol import ResponseStatus, SlotLayout

HIDDEN, EXPERTS, TOPK = 16, 2, 1
LAYOUT = SlotLayout(4, HIDDEN, TOPK, "f32", "f32")


def make_server(transport, name):
    return ExpertServer(random_experts(1, EXPERTS, HIDDEN, 8, seed=1), name, transport)


def connect(server, transport, client_id=1):
    ch = ClientChannel(transport, LAYOUT, client_id, num_slots=2)
    info = server.connect(client_id, ch.handle, LAYOUT, 2)
    ch.connect(info["server_handle"], info["doorbell_handle"])
    return ch


def send(ch, slot=0, n=2):
    x = torch.ones(n, HIDDEN)
    return ch.send(slot, x, torch.zeros(n, TOPK, dtype=torch.int32), torch.ones(n, TOPK))


class Exploding:
    """Weights whose forward raises, as a real kernel failure would (once)."""

    def __init__(self, layer):
        self.layer, self.armed = layer, True

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def forward(self, *args, **kwargs):
        if self.armed:
            self.armed = False
            raise RuntimeError("kernel fault")
        return self.layer.forward(*args, **kwargs)


@pytest.mark.timeout(60)
def test_a_failing_batch_is_answered_with_its_cause_and_the_loop_goes_on(transport):
    server = make_server(transport, "s-batch")
    server.layers[0] = Exploding(server.layers[0])
    ch = connect(server, transport)
    server.start()
    try:
        seq = send(ch)
        with pytest.raises(RemoteError) as err:
            ch.wait(0, seq, timeout=10)
        assert err.value.status == int(ResponseStatus.SERVER_ERROR)
        assert "kernel fault" in err.value.reason and "s-batch" in err.value.reason
        ch.release(0)
        seq = send(ch)
        assert ch.wait(0, seq, timeout=10).activations.shape == (2, HIDDEN)
        assert server.health.ok and server.stats.batch_failures == 1
        assert server.stats.rejected_by_status["server_error"] == 1
    finally:
        server.close()
        ch.close()


@pytest.mark.timeout(60)
def test_a_loop_that_fails_marks_the_server_unhealthy_and_tells_everyone(
    transport, monitor_process
):
    membership = connect_membership(monitor_process.url, MONITOR_TOKEN)
    server = make_server(transport, "s-dies")
    http = HttpServer(make_app(server))
    url = http.start()
    server.join_membership(membership, url, ttl=5.0)
    ch = connect(server, transport)
    server.start()
    try:
        assert "s-dies" in {m.member_id for m in membership.list_members("server")}
        seq = send(ch)
        ch.wait(0, seq, timeout=10)
        ch.release(0)

        # An unexpected fault outside any batch (a bug, a broken region): injected here.
        def broken_poll():
            raise RuntimeError("poll fault")

        server._poll = broken_poll
        server.wake()
        deadline = time.monotonic() + 10
        while server.health.ok and time.monotonic() < deadline:
            time.sleep(0.01)
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 503 and "poll fault" in r.text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'moecomm_server_loop_failed{server="s-dies"} 1' in metrics
        assert "s-dies" not in {m.member_id for m in membership.list_members("server")}
        seq = send(ch, slot=1)
        start = time.monotonic()
        with pytest.raises(PeerOfflineError):
            ch.wait(1, seq, timeout=10)
        assert time.monotonic() - start < 1.0, "the client waited for its deadline"
        with pytest.raises(MoecommError, match="unhealthy"):
            connect(server, transport, client_id=2)
    finally:
        http.stop()
        server.close()
        membership.close()
        ch.close()
