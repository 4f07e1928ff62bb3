"""The expert server's step through warm buffers, answering straight into the client's slot.

Checked here: answers bit-exact against the plain per-layer forward with sizes and encodings
changing every step and slots reused at once; a client whose memory is not mapped (the nixl
case) answered through the copy path in the same pass; and, with an allocation counter (the
torch profiler's memory events), that a warm server step allocates no activation-sized storage.
"""

import moecomm.wire.channel as slot_channel
import pytest
import torch
from moecomm.ops import quantize
from moecomm.runtime import ExpertServer
from moecomm.runtime.experts import LayerExperts, random_experts
from moecomm.wire.client import ClientChannel
from moecomm.wire.protocol import SlotLayout
from moecomm.wire.server import ServerChannel
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

HIDDEN, INTER, EXPERTS, TOPK, MAX_TOKENS = 256, 64, 8, 2, 32
WEIGHTS = random_experts(2, EXPERTS, HIDDEN, INTER, seed=5)
# Storage at least this big counts as activation-sized: one token's f32 row is 1 KiB here, the
# smallest step's activations several; the per-request metadata copies (ids, scores) are below.
ALLOC_THRESHOLD = 4096


@pytest.fixture(autouse=True)
def poison_on(monkeypatch):
    monkeypatch.setattr(slot_channel, "POISON_SLOTS", True)


def request(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g)
    ids = torch.randint(-1, EXPERTS, (n, TOPK), generator=g, dtype=torch.int32)
    return x, ids, torch.rand(n, TOPK, generator=g)


def reference(layer: int, x, ids, w):
    (y,) = LayerExperts(layer, WEIGHTS[layer]).forward([x], [ids], [w])
    return y


def connect(server, transport, client_id: int, layout: SlotLayout):
    ch = ClientChannel(transport, layout, client_id=client_id, num_slots=2)
    info = server.connect(client_id, ch.handle, layout, 2)
    ch.connect(info["server_handle"], info["doorbell_handle"])
    return ch


@pytest.mark.timeout(120)
def test_answers_are_exact_with_sizes_encodings_and_mapping_changing(transport, monkeypatch):
    """Three clients in one pass — f32 wire, int8 wire, and one whose memory the server is made
    not to map — sizes changing every step, both slots reused the moment their answer was read.
    Mapped clients are answered in place (never through the copying respond)."""
    copied = []
    respond = ServerChannel.respond
    monkeypatch.setattr(
        ServerChannel,
        "respond",
        lambda ch, req, y: copied.append(ch.client_id) or respond(ch, req, y),
    )
    server = ExpertServer(WEIGHTS, "step", transport)
    f32 = SlotLayout(MAX_TOKENS, HIDDEN, TOPK, "f32", "f32")
    int8 = SlotLayout(MAX_TOKENS, HIDDEN, TOPK, "int8", "bf16")
    clients = {1: connect(server, transport, 1, f32), 2: connect(server, transport, 2, int8)}
    clients[3] = connect(server, transport, 3, f32)
    remote = next(c for c in server.clients.channels() if c.client_id == 3)
    remote._client_views = None  # as for a nixl client: answered by copy
    try:
        for step in range(24):
            slot, layer = step % 2, step % 3 % 2
            sent = {}
            for cid, ch in clients.items():
                n = 1 + (step * 7 + cid * 5) % MAX_TOKENS
                x, ids, w = request(n, 100 * step + cid)
                if cid == 2:
                    q, s = quantize(x, ch.layout.encoding)
                    seq = ch.send(slot, q, ids, w, layer_id=layer, scales=s)
                    want = (
                        LayerExperts(layer, WEIGHTS[layer])
                        .forward([q.float() * s], [ids], [w])[0]
                        .to(torch.bfloat16)
                    )
                else:
                    v = ch.request_views(slot, n, TOPK)
                    v.activations.copy_(x), v.expert_ids.copy_(ids), v.scores.copy_(w)
                    seq = ch.commit(slot, n, TOPK, layer_id=layer)
                    want = reference(layer, x, ids, w)
                sent[cid] = (seq, want)
            while server.step(timeout=1.0):
                pass
            for cid, (seq, want) in sent.items():
                got = clients[cid].wait(slot, seq, timeout=10.0).activations
                assert torch.equal(got, want), f"step {step} client {cid}"
                clients[cid].release(slot)
        assert server.health.ok, server.health.reason
        assert set(copied) == {3} and len(copied) == 24
    finally:
        server.close()
        for ch in clients.values():
            ch.close()


def large_allocations(fn) -> list[int]:
    """Sizes of the storage allocations of at least ALLOC_THRESHOLD bytes while fn runs: every
    allocation the profiler records, one by one (also temporaries freed inside the same op)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = []

    def walk(node) -> None:
        if node.tag == _EventType.Allocation and node.extra_fields.alloc_size >= ALLOC_THRESHOLD:
            sizes.append(node.extra_fields.alloc_size)
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return sizes


@pytest.mark.timeout(120)
def test_a_warm_step_allocates_no_activation_sized_storage(transport):
    server = ExpertServer(WEIGHTS, "alloc", transport)
    ch = connect(server, transport, 1, SlotLayout(MAX_TOKENS, HIDDEN, TOPK, "f32", "f32"))
    try:
        sizes = [MAX_TOKENS, 3, 17, 1, 29, 8, MAX_TOKENS, 12]
        for step, n in enumerate(sizes * 2):
            x, ids, w = request(n, step)
            seq = ch.send(0, x, ids, w, layer_id=step % 2)
            warm = step >= len(sizes)
            if warm:
                allocs = large_allocations(lambda: server.step(timeout=1.0))
                assert allocs == [], f"step {step} ({n} tokens) allocated {allocs} bytes"
            else:
                server.step(timeout=1.0)
            got = ch.wait(0, seq, timeout=10.0).activations
            assert torch.equal(got, reference(step % 2, x, ids, w))
            ch.release(0)
    finally:
        server.close()
        ch.close()


def test_the_counter_sees_the_allocations_of_a_plain_forward():
    """The counter is real: the plain (allocating) forward of the same step trips it."""
    x, ids, w = request(MAX_TOKENS, 0)
    layer = LayerExperts(0, WEIGHTS[0])
    layer.forward([x], [ids], [w])
    assert large_allocations(lambda: layer.forward([x], [ids], [w]))


@pytest.mark.timeout(120)
def test_a_prefill_sized_layout_reserves_a_bounded_workspace(transport, monkeypatch):
    """A client whose slots could carry far more rows than the reservation cap (here lowered
    to 64 KiB of activations) does not make the server hold buffers for all of them up front;
    steps of the sizes it really sends are answered, growing the buffers as they need."""
    import moecomm.runtime.server_step as server_step

    monkeypatch.setattr(server_step, "RESERVE_BYTES", 64 << 10)
    server = ExpertServer(WEIGHTS, "reserve", transport)
    ch = connect(server, transport, 1, SlotLayout(1024, HIDDEN, TOPK, "f32", "f32"))
    try:
        for step, n in enumerate([5, 700, 3]):
            x, ids, w = request(n, step)
            seq = ch.send(0, x, ids, w)
            server.step(timeout=1.0)
            got = ch.wait(0, seq, timeout=10.0).activations
            assert torch.equal(got, reference(0, x, ids, w))
            ch.release(0)
            if step == 0:  # reserved: capped, not 2 slots x 1024 tokens x top-2
                assert server.buffers.ws.max_rows * HIDDEN * 4 <= 64 << 10
        assert server.buffers.ws.max_rows > (64 << 10) // (HIDDEN * 4)  # grown by the big step
    finally:
        server.close()
        ch.close()
