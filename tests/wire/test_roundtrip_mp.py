"""Round trips between real processes: a client here, an identity expert server in a spawned
process. Payloads carry their own origin (moecomm.testing); responses are compared bit-exactly.

CI runs >= 10^4 round trips; MOECOMM_LONG=1 runs 10x more (a pressure run)."""

import moecomm
import pytest
import torch
from long_run import LONG
from moecomm.testing import make_pattern, spawn_identity_server
from moecomm.wire.client import ClientChannel

ROUND_TRIPS = 100_000 if LONG else 10_000
SEED = 1234


def run_round_trips(transport, layout, reaper, client_id, count, num_slots=2):
    server = reaper.server(spawn_identity_server(layout, client_id, num_slots))
    client = ClientChannel(transport, layout, client_id, num_slots)
    client.connect(server.handle)
    server.connect(client.handle)
    gen = torch.Generator().manual_seed(SEED + client_id)
    sizes = torch.randint(1, layout.max_tokens + 1, (count,), generator=gen).tolist()
    done = 0
    digest = 0
    while done < count:
        inflight = []
        for slot in range(min(num_slots, count - done)):
            n = sizes[done + slot]
            x, ids, scores, scales = make_pattern(client_id, client.peek_seq(), n, layout, gen)
            seq = client.send(slot, x, ids, scores, layer_id=seq_layer(done + slot), scales=scales)
            inflight.append((slot, seq, x, n))
        for slot, seq, x, n in inflight:
            resp = client.wait(slot, seq, timeout=20.0)
            assert resp.num_tokens == n and resp.seq == seq
            assert resp.layer_id == seq_layer(done + slot)
            got = resp.activations
            want = x if x.dtype == got.dtype else x.to(got.dtype)
            assert torch.equal(got, want), f"payload mismatch at seq {seq}"
            digest = (digest * 31 + int(got.view(torch.uint8).sum())) % (1 << 61)
        done += len(inflight)
    stats = server.stop()
    client.close()
    assert stats == {"served": count, "rejected": 0}
    # Both ends removed their segments: the server on exit, the client on close.
    assert moecomm.list_segments(server.process.pid) == []
    assert client.handle[len("shm:") :] not in moecomm.list_segments()
    return digest


def seq_layer(i):
    return i % 61


@pytest.mark.timeout(600)
def test_ten_thousand_round_trips_bit_exact(transport, reaper):
    layout = moecomm.SlotLayout(max_tokens=16, hidden=64, topk=4)
    run_round_trips(transport, layout, reaper, client_id=3, count=ROUND_TRIPS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("encoding", "hidden"), [("f32", 111), ("fp16", 128), ("int8", 300), ("bf16", 7168)]
)
def test_round_trips_across_encodings_and_awkward_sizes(transport, reaper, encoding, hidden):
    layout = moecomm.SlotLayout(max_tokens=9, hidden=hidden, topk=3, encoding=encoding)
    run_round_trips(transport, layout, reaper, client_id=5, count=200, num_slots=3)


@pytest.mark.timeout(300)
def test_repeated_runs_give_identical_digests(transport, reaper):
    # Pressure mode in miniature: the same run twice must hash the same.
    layout = moecomm.SlotLayout(max_tokens=8, hidden=40, topk=2)
    a = run_round_trips(transport, layout, reaper, client_id=9, count=500)
    b = run_round_trips(transport, layout, reaper, client_id=9, count=500)
    assert a == b
