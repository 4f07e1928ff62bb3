"""Zero-copy messages: a client packs its request straight into the server's slot
(`request_views` + `commit`) and a server writes its answer straight into the client's
(`response_view` + `commit_response`). The reader sees the same protocol as for a copied
message; sizes change every step, slots are reused the instant they are free, released slots
are poisoned (conftest), and a bad shape is refused before a header goes out."""

import moecomm.wire.channel as slot_channel
import pytest
import torch
from moecomm.errors import RemoteError
from moecomm.ops.dispatch import ExpertMap, pack_dispatch
from moecomm.wire.client import ClientChannel
from moecomm.wire.protocol import ResponseStatus, SlotLayout
from moecomm.wire.server import ServerChannel

HIDDEN, TOPK, MAX_TOKENS, NUM_SLOTS = 48, 4, 16, 2


@pytest.fixture(autouse=True)
def poison_on(monkeypatch):
    monkeypatch.setattr(slot_channel, "POISON_SLOTS", True)


def make_pair(transport, layout):
    server = ServerChannel(transport, layout, 7, NUM_SLOTS)
    client = ClientChannel(transport, layout, 7, NUM_SLOTS)
    client.connect(server.handle)
    server.connect(client.handle)
    return server, client


@pytest.fixture
def pair(transport):
    server, client = make_pair(transport, SlotLayout(MAX_TOKENS, HIDDEN, TOPK, "f32", "f32"))
    try:
        yield server, client
    finally:
        server.close()
        client.close()


def batch(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g)
    ids = torch.randint(-1, 10, (n, k), generator=g, dtype=torch.int32)
    return x, ids, torch.rand(n, k, generator=g)


def fill(views, x, ids, scores) -> None:
    views.activations.copy_(x)
    views.expert_ids.copy_(ids)
    views.scores.copy_(scores)


def test_both_ways_in_place_with_sizes_changing_and_slots_reused_at_once(pair):
    """Each step another (tokens, topk), written in place into a slot the instant its previous
    answer was read and released; the server answers in place with a function of the request
    it can only know from the slot, so a stale or poisoned byte shows."""
    server, client = pair
    assert client.zero_copy
    rng = torch.Generator().manual_seed(3)
    for step in range(60):
        slot = step % NUM_SLOTS
        n = int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=rng))
        k = int(torch.randint(1, TOPK + 1, (1,), generator=rng))
        x, ids, scores = batch(n, k, step)
        fill(client.request_views(slot, n, k), x, ids, scores)
        seq = client.commit(slot, n, k, layer_id=step % 3)
        (req,) = server.poll()
        assert (req.slot, req.seq, req.num_tokens, req.topk, req.layer_id) == (
            slot,
            seq,
            n,
            k,
            step % 3,
        )
        assert torch.equal(req.activations, x)
        assert torch.equal(req.expert_ids, ids) and torch.equal(req.scores, scores)
        out = server.response_view(req)
        assert out.shape == (n, HIDDEN)
        torch.mul(req.activations, req.scores.sum(1, keepdim=True), out=out)
        server.commit_response(req)
        assert req.activations is None  # released with the answer
        y = client.wait(slot, seq, timeout=5.0).activations
        assert torch.equal(y, x * scores.sum(1, keepdim=True))
        client.release(slot)
        assert bool(torch.isnan(y).all()), "the released response slot was not poisoned"


def test_in_place_and_copied_messages_mix_on_one_connection(pair):
    server, client = pair
    x, ids, scores = batch(5, TOPK, 1)
    fill(client.request_views(0, 5, TOPK), x, ids, scores)
    s0 = client.commit(0, 5, TOPK)
    s1 = client.send(1, x * 2, ids, scores)
    reqs = {r.slot: r for r in server.poll()}
    assert torch.equal(reqs[0].activations, x) and torch.equal(reqs[1].activations, x * 2)
    server.respond(reqs[0], reqs[0].activations + 1)
    server.response_view(reqs[1]).copy_(reqs[1].activations - 1)
    server.commit_response(reqs[1])
    assert torch.equal(client.wait(0, s0, 5.0).activations, x + 1)
    assert torch.equal(client.wait(1, s1, 5.0).activations, x * 2 - 1)


@pytest.mark.parametrize("n, k", [(0, 1), (MAX_TOKENS + 1, 1), (1, 0), (1, TOPK + 1)])
def test_a_bad_shape_is_refused_before_anything_is_published(pair, n, k):
    server, client = pair
    with pytest.raises(ValueError, match="outside"):
        client.request_views(0, n, k)
    with pytest.raises(ValueError):  # checked again in C++ before the header is written
        client.commit(0, n, k)
    assert server.poll() == []
    # The connection goes on: the sequence number was not spent.
    x, ids, scores = batch(2, 2, 0)
    fill(client.request_views(0, 2, 2), x, ids, scores)
    seq = client.commit(0, 2, 2)
    (req,) = server.poll()
    assert req.seq == seq == 1 and torch.equal(req.activations, x)


def test_views_need_a_connection_and_a_real_slot(transport):
    layout = SlotLayout(MAX_TOKENS, HIDDEN, TOPK, "f32", "f32")
    client = ClientChannel(transport, layout, 7, NUM_SLOTS)
    try:
        with pytest.raises(RuntimeError, match="before connect"):
            client.request_views(0, 1, 1)
        server = ServerChannel(transport, layout, 7, NUM_SLOTS)
        client.connect(server.handle)
        with pytest.raises(ValueError, match="slot"):
            client.request_views(NUM_SLOTS, 1, 1)
        server.close()
    finally:
        client.close()


@pytest.mark.parametrize("encoding", ["bf16", "fp8_e4m3", "int8"])
def test_pack_dispatch_writes_the_slot_bit_for_bit_like_the_staged_path(transport, encoding):
    """pack_dispatch(into=...) leaves in the server's slot exactly the arrays the staged path
    sends, for every encoding (quantized ones with their scales), and writes every element."""
    layout = SlotLayout(MAX_TOKENS, 256, TOPK, encoding, "f32")
    server, client = make_pair(transport, layout)
    try:
        g = torch.Generator().manual_seed(11)
        x = torch.randn(MAX_TOKENS, 256, generator=g).to(torch.bfloat16)
        ids = torch.randint(-1, 8, (MAX_TOKENS, TOPK), generator=g)
        w = torch.rand(MAX_TOKENS, TOPK, generator=g)
        emap = ExpertMap([[(e % 2, e // 2)] for e in range(8)], num_servers=2)
        enc = client.layout.encoding
        staged = {b.server: b for b in pack_dispatch(x, ids, w, emap, encoding=enc)}
        for b in staged.values():
            # Poison the slot first: an element the pack does not write would show.
            v = client.request_views(0, b.num_tokens, TOPK, enc)
            for t in (v.activations, v.expert_ids, v.scores, v.scales):
                if t is not None:
                    t.view(torch.uint8).fill_(0xFF)
            (got,) = pack_dispatch(
                x,
                ids,
                w,
                emap,
                encoding=enc,
                into=lambda s, n, k, v=v, want=b.server: v if s == want else None,
            )[b.server : b.server + 1]
            assert got.in_place and got.activations.data_ptr() == v.activations.data_ptr()
            for name in ("activations", "scales", "expert_ids", "scores"):
                a, c = getattr(b, name), getattr(got, name)
                assert (a is None) == (c is None)
                if a is not None:
                    assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)), name
            seq = client.commit(0, b.num_tokens, TOPK, encoding=enc)
            (req,) = server.poll()
            assert req.seq == seq and torch.equal(
                req.activations.view(torch.uint8), b.activations.view(torch.uint8)
            )
            server.reject(req, ResponseStatus.SERVER_ERROR, "checked, not served")
            with pytest.raises(RemoteError, match="checked, not served"):
                client.wait(0, seq, 5.0)
            client.release(0)
    finally:
        server.close()
        client.close()
