"""A server of several clients sleeps on one shared doorbell and still sees every request."""

import threading

import moecomm
import torch
from moecomm import _C
from moecomm.testing import make_pattern
from moecomm.wire.client import ClientChannel
from moecomm.wire.server import ServerChannel
from moecomm.wire.transport import WaitStatus

LAYOUT = moecomm.SlotLayout(max_tokens=4, hidden=16, topk=2)


def test_shared_doorbell_wakes_the_server_for_any_client():
    t = moecomm.ShmTransport(spin_ns=0)  # go straight to the futex: the wake-up is what we test
    doorbell = t.create_region(64)
    clients, servers = [], []
    for cid in (1, 2, 3):
        c, s = ClientChannel(t, LAYOUT, cid), ServerChannel(t, LAYOUT, cid)
        c.connect(s.handle, doorbell.handle)
        s.connect(c.handle)
        clients.append(c)
        servers.append(s)
    seen = t.load(doorbell, 0)
    assert all(s.poll() == [] for s in servers)
    x, ids, scores, _ = make_pattern(2, clients[1].peek_seq(), 3, LAYOUT)
    threading.Timer(0.05, lambda: clients[1].send(1, x, ids, scores)).start()
    status, value = _C.wait_doorbell(t, doorbell, seen, 5_000_000_000)
    assert status == WaitStatus.OK and value == seen + 1
    ready = [(i, r) for i, s in enumerate(servers) for r in s.poll()]
    assert len(ready) == 1
    i, req = ready[0]
    assert i == 1 and req.slot == 1 and torch.equal(req.activations, x)
    # The slot region's own doorbell was not used.
    assert t.load(servers[1].region, 0) == 0
