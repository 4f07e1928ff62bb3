"""Read once, own the copy: an expert server never reads a request slot after it released it,
and a client never reads a response slot after it released it. With slot poisoning on (the test
suite sets MOECOMM_POISON_SLOTS=1 in conftest.py) a release overwrites the slot, so any late read
fails every time: the server loop of the release before this rule read its statistics from the
released slot and died on the poison (expert id 0x00BADBAD) at the first request."""

import moecomm.wire.channel as slot_channel
import pytest
import torch
from moecomm import _C
from moecomm.runtime import ExpertServer
from moecomm.runtime.experts import LayerExperts, random_experts
from moecomm.wire.client import ClientChannel
from moecomm.wire.protocol import SlotLayout
from moecomm.wire.server import ServerChannel
from moecomm.wire.views import RegionViews

HIDDEN, INTER, EXPERTS, TOPK, MAX_TOKENS = 32, 16, 4, 2, 8
EXPERT_WEIGHTS = random_experts(1, EXPERTS, HIDDEN, INTER, seed=7)
LAYOUT = SlotLayout(MAX_TOKENS, HIDDEN, TOPK, "f32", "f32")
POISON_ID = 0x00BADBAD  # protocol/poison.h


@pytest.fixture(autouse=True)
def poison_on(monkeypatch):
    """Channels read the switch when they are made: force it for the in-process ones here."""
    monkeypatch.setattr(slot_channel, "POISON_SLOTS", True)


@pytest.fixture
def pair(transport):
    """A server end and a client end of one connection with one slot, connected."""
    server = ServerChannel(transport, LAYOUT, 1, 1)
    client = ClientChannel(transport, LAYOUT, 1, 1)
    try:
        client.connect(server.handle)
        server.connect(client.handle)
        yield server, client
    finally:
        server.close()
        client.close()


def request(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g)
    ids = torch.randint(-1, EXPERTS, (n, TOPK), generator=g, dtype=torch.int32)
    return x, ids, torch.rand(n, TOPK, generator=g)


def reference(x, ids, w):
    (y,) = LayerExperts(0, EXPERT_WEIGHTS[0]).forward([x], [ids], [w])
    return y


@pytest.mark.timeout(120)
def test_a_server_serves_slots_reused_at_once_with_sizes_changing_every_step(transport):
    """Two slots in flight, each reused the instant its answer arrives, with another token
    count every time: every answer is exact, the loop stays healthy, and the per-expert load it
    reports was counted from its own copies, not from the (poisoned) slot."""
    server = ExpertServer(EXPERT_WEIGHTS, "read-once", transport)
    client = ClientChannel(transport, LAYOUT, client_id=5, num_slots=2)
    try:
        info = server.connect(5, client.handle, LAYOUT, 2)
        client.connect(info["server_handle"], info["doorbell_handle"])
        server.start()
        want_load = torch.zeros(EXPERTS, dtype=torch.int64)
        pending = {}
        for step in range(40):
            slot = step % 2
            if slot in pending:
                seq, want = pending.pop(slot)
                got = client.wait(slot, seq, timeout=10.0).activations.clone()
                client.release(slot)
                assert torch.equal(got, want), f"step {step}"
            n = 1 + (step * 5) % MAX_TOKENS
            x, ids, w = request(n, step)
            want_load += torch.bincount(ids[ids >= 0].long(), minlength=EXPERTS)
            pending[slot] = (client.send(slot, x, ids, w), reference(x, ids, w))
        for slot, (seq, want) in pending.items():
            assert torch.equal(client.wait(slot, seq, timeout=10.0).activations, want)
        assert server.health.ok, server.health.reason
        load = [server.stats.expert_load.get((0, e), 0) for e in range(EXPERTS)]
        assert load == want_load.tolist()
    finally:
        server.close()
        client.close()


def test_a_request_keeps_what_was_validated_when_the_client_rewrites_its_slot(pair):
    """The server's ids and scores are copies: a client that rewrites its slot after the server
    took the request cannot slip unvalidated ids in."""
    server, client = pair
    x, ids, w = request(4, 1)
    client.send(0, x, ids, w)
    (req,) = server.poll()
    client.send(0, x, torch.full_like(ids, 1 << 20), w * 2)  # a rewrite, valid or not
    assert torch.equal(req.expert_ids, ids) and torch.equal(req.scores, w)


def test_a_released_request_slot_is_poisoned_before_the_client_sees_the_answer(pair):
    server, client = pair
    x, ids, w = request(3, 2)
    seq = client.send(0, x, ids, w)
    (req,) = server.poll()
    views = RegionViews(server.region)
    off = server.request_ring.slot_offset(0) + _C.PAYLOAD_OFFSET
    server.respond(req, x)
    assert req.activations is None  # the view is dropped with the release
    acts = views.get(off, (3, HIDDEN), torch.float32)
    assert bool(torch.isnan(acts).all()), "activations were not poisoned"
    raw = views.bytes[off : off + server.request_ring.slot_bytes - _C.PAYLOAD_OFFSET]
    assert (raw.view(torch.int32) == POISON_ID).sum() == ids.numel()
    assert torch.equal(client.wait(0, seq, timeout=5.0).activations, x)


def test_a_released_response_slot_reads_as_nan(pair):
    server, client = pair
    x, ids, w = request(2, 3)
    seq = client.send(0, x, ids, w)
    (req,) = server.poll()
    server.respond(req, x)
    resp = client.wait(0, seq, timeout=5.0)
    assert torch.equal(resp.activations, x)
    client.release(0)
    assert bool(torch.isnan(resp.activations).all()), "a late read would go unnoticed"


def test_poisoning_spares_a_newer_request_the_client_already_wrote(pair):
    """A client that gave up on a request may reuse its slot before the server answers the old
    one: the late release must neither wipe nor poison the newer request."""
    server, client = pair
    x, ids, w = request(2, 4)
    client.send(0, x, ids, w)
    (old,) = server.poll()
    x2, ids2, w2 = request(5, 5)
    seq2 = client.send(0, x2, ids2, w2)
    server.respond(old, torch.zeros(2, HIDDEN))  # late answer: dropped by its sequence
    (new,) = server.poll()
    assert new.seq == seq2 and torch.equal(new.expert_ids, ids2)
    assert torch.equal(new.activations, x2)
    server.respond(new, x2)
    assert torch.equal(client.wait(0, seq2, timeout=5.0).activations, x2)


def test_poison_mode_is_on_in_the_test_suite():
    """conftest.py turns it on for every process the suite starts."""
    import os

    assert os.environ.get(slot_channel.POISON_ENV) == "1"
