"""The staged KV hand-off across hosts (moecomm_serving.disagg.staged, the byte package of
moecomm_serving.kv.package): the package format round-trips bit-exactly and
refuses every malformed package with a clear KvHandoffError; packages travel between real
processes over shm (several sizes, two senders at once, slots reused back to back, slot poisoning
on) and over nixl between network namespaces; a sender killed mid-package fails only its own
package, a dead decode side fails the send (never a hang), a sender that breaks a package rule
gets the rule at once and the others are served, a connection the outbox drops is freed at the
decode side, bad connect and disconnect requests get 400s, and an unclaimed package expires."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import random
import signal
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import kv_handoff_procs as procs
import pytest
import torch
from fastapi import FastAPI
from moecomm.errors import DeadlineExceededError, PeerLostError, RemoteError
from moecomm.http_thread import HttpServer
from moecomm.wire.channel import POISON_SLOTS
from moecomm.wire.protocol import PAYLOAD_OFFSET, SlotLayout
from moecomm.wire.shm import ShmTransport, reap_stale_segments
from moecomm.wire.stage import StageSender
from moecomm_serving.disagg.staged import KvInbox, KvOutbox, install_kv_routes, kv_layout
from moecomm_serving.disagg.transfer import KvTransferError
from moecomm_serving.kv.blocks import BlockPool, PagedSequence
from moecomm_serving.kv.package import (
    PACKAGE_MAGIC,
    KvHandoffError,
    PackedKv,
    decode_package,
    encode_package,
    pack,
    unpack,
)

# Small slots so that modest packages span many chunks (4 KiB of payload + the header's slack).
SLOT_BYTES, SLOTS = 4096, 2
DEADLINE_S = 30.0
# A sender killed mid-package, or a dead decode side, is noticed by a liveness check (every
# 0.1 s) or at the next acknowledgement wait: well under this on a loaded machine.
LOSS_S = 10.0
# A chunk that breaks a rule is refused at the inbox's next poll (its thread sleeps at most
# 50 ms) and the sender's acknowledgement wait reads the refusal at once: about a millisecond,
# with room for a loaded 2-core machine; far below DEADLINE_S, so a wait for the deadline shows.
REFUSAL_S = 3.0


# ---------------------------------------------------------------------------------- helpers
def paged_package(dtype, heads=2, k_dim=8, v_dim=8, length=37, block_tokens=16, seed=0):
    """A real export_blocks() of a sequence of `length` tokens with seeded values, packed."""
    g = torch.Generator().manual_seed(seed)
    pool = BlockPool([3, 4, 5], heads, k_dim, v_dim, dtype, "cpu", block_tokens=block_tokens)
    seq = PagedSequence(pool)
    for layer in pool.layers:
        k = torch.randn(heads, length, k_dim, generator=g).to(dtype)
        v = torch.randn(heads, length, v_dim, generator=g).to(dtype)
        seq.append(layer, k, v)
    return pool, seq, pack(seq.export_blocks())


def same_package(a: PackedKv, b: PackedKv) -> bool:
    ta, tb = (a.k, a.v), (b.k, b.v)
    return a.meta() == b.meta() and all(
        x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(ta, tb, strict=True)
    )


def forge(header: dict, payload: bytes, magic: bytes = PACKAGE_MAGIC) -> bytes:
    head = json.dumps(header).encode()
    return magic + struct.pack("<I", len(head)) + head + payload


def wait_until(cond, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.01)


@pytest.fixture
def inbox_server():
    """A KvInbox (shm, small slots) behind a real HTTP server in this process."""
    made = []

    def start(ttl_s: float = 60.0, getter=None, transport="shm", **kw):
        inbox = KvInbox(transport, slot_bytes=SLOT_BYTES, num_slots=SLOTS, ttl_s=ttl_s, **kw)
        inbox.start()
        app = FastAPI()
        install_kv_routes(app, getter or (lambda: inbox))
        server = HttpServer(app, what="the test's KV inbox")
        made.append((inbox, server))
        return inbox, server.start()

    yield start
    for inbox, server in made:
        server.stop()
        inbox.close()


@pytest.fixture
def children():
    """Spawned children, killed and reaped even when the test fails."""
    ctx = mp.get_context("spawn")
    started = []

    def start(target, *args):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        started.append((p, parent))
        return p, parent

    yield start
    for p, parent in started:
        if p.is_alive():
            with contextlib.suppress(OSError):
                parent.send("exit")
            p.join(5)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(DEADLINE_S)
        reap_stale_segments(p.pid)


def recv(conn, timeout: float = DEADLINE_S):
    assert conn.poll(timeout), "the child said nothing in time"
    msg = conn.recv()
    assert msg[0] != "error", msg
    return msg


# ---------------------------------------------------------------------------------- 1. format
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_a_real_export_round_trips_bit_exactly(dtype, shape):
    heads, kd, vd = (2, 8, 8) if shape == "gqa" else (1, 12, 4)  # MLA: latent | rotated key
    pool, seq, package = paged_package(dtype, heads, kd, vd, length=37)
    data = encode_package(package, "req-1")
    assert data.dtype == torch.uint8 and data.dim() == 1
    back = decode_package(data, "req-1")
    assert same_package(back, package)
    assert back.k.data_ptr() != data.data_ptr()  # their own memory
    assert same_package(decode_package(bytes(data.numpy())), package)  # from bytes too
    # And the package imports into another pool as the same cache.
    pool2 = BlockPool(pool.layers, heads, kd, vd, dtype, "cpu", block_tokens=pool.block_tokens)
    seq2 = PagedSequence.import_blocks(pool2, unpack(pool2, back))
    for layer in pool.layers:
        for a, b in zip(seq.gather(layer), seq2.gather(layer), strict=True):
            assert torch.equal(a, b)


def test_a_sequence_of_length_zero_is_a_package_with_no_blocks():
    package = procs.empty_kv_package()
    assert package.k.shape[1] == 0
    back = decode_package(encode_package(package, "empty"))
    assert same_package(back, package) and back.length == 0
    assert back.k.shape == package.k.shape


# ---------------------------------------------------------------------------------- 2. refusals
def _good():
    _, _, package = paged_package(torch.float16, length=5, block_tokens=4)
    data = encode_package(package, "id")
    hlen = struct.unpack("<I", bytes(data[8:12].tolist()))[0]
    header = json.loads(bytes(data[12 : 12 + hlen].tolist()))
    return bytes(data.numpy()), header, bytes(data[12 + hlen :].numpy())


def _changed(**kw):
    _, header, payload = _good()
    header.update(kw)
    return forge(header, payload)


def _without(key):
    _, header, payload = _good()
    del header[key]
    return forge(header, payload)


CORRUPTIONS = {
    "wrong magic": (lambda: forge(_good()[1], _good()[2], b"NOTKVPKG"), "magic"),
    "shorter than the prefix": (lambda: _good()[0][:5], "truncated"),
    "header cut": (lambda: _good()[0][:20], "truncated"),
    "data cut": (lambda: _good()[0][:-1], "do not add up"),
    "a byte too many": (lambda: _good()[0] + b"\0", "do not add up"),
    "header length absurd": (
        lambda: PACKAGE_MAGIC + struct.pack("<I", 0xFFFFFFFF) + b"{}",
        "truncated",
    ),
    "header not UTF-8": (lambda: PACKAGE_MAGIC + struct.pack("<I", 2) + b"\xff\xfe", "UTF-8"),
    "header not JSON": (lambda: PACKAGE_MAGIC + struct.pack("<I", 3) + b"{x}", "JSON"),
    "header a list": (lambda: forge([1, 2], b""), "keys"),  # type: ignore[arg-type]
    "key missing": (lambda: _without("dtype"), "keys"),
    "key extra": (lambda: _changed(extra=1), "keys"),
    "length a string": (lambda: _changed(length="5"), "length must be an int"),
    "length a bool": (lambda: _changed(length=True), "length must be an int"),
    "length negative": (lambda: _changed(length=-4), "length must be an int"),
    "kv_shape negative": (lambda: _changed(kv_shape=[2, -8, 8]), "kv_shape"),
    "kv_shape short": (lambda: _changed(kv_shape=[2, 8]), "kv_shape"),
    "block_tokens zero": (lambda: _changed(block_tokens=0), "block_tokens"),
    "layers empty": (lambda: _changed(layers=[]), "layers"),
    "layers repeat": (lambda: _changed(layers=[3, 3, 5]), "layers"),
    "unknown dtype": (lambda: _changed(dtype="int8"), "dtype"),
    "other version": (lambda: _changed(version=99), "version"),
    "k_shape inconsistent": (lambda: _changed(k_shape=[3, 1, 2, 8, 8]), "k_shape"),
    "absurd length (overflow)": (
        lambda: _changed(length=10**30, k_shape=[3, 25 * 10**28, 2, 4, 8]),
        "",
    ),
    "handoff id a number": (lambda: _changed(handoff_id=7), "handoff_id"),
    "another hand-off": (lambda: _changed(handoff_id="other"), "expected 'id'"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_a_malformed_package_is_refused_with_a_clear_message(case):
    make, words = CORRUPTIONS[case]
    with pytest.raises(KvHandoffError, match=words or None) as err:
        decode_package(make(), "id")
    assert "KV package" in str(err.value)


def test_the_good_package_of_the_refusal_cases_is_accepted():
    assert decode_package(_good()[0], "id").length == 5


def test_random_corruption_is_refused_or_read_never_anything_else():
    good, header, _ = _good()
    end_of_header = 12 + len(json.dumps(header))
    rng = random.Random(1234)
    refused = 0
    for _ in range(200):
        data = bytearray(good)
        if rng.random() < 0.4:
            data = data[: rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(min(end_of_header + 8, len(data)))] = rng.randrange(256)
        try:
            out = decode_package(bytes(data), "id")
        except KvHandoffError:
            refused += 1
        else:  # a flip that kept the header meaningful: still a consistent package
            assert out.k.numel() + out.v.numel() > 0
    assert refused > 150


def test_encode_refuses_a_package_that_does_not_add_up():
    _, _, package = paged_package(torch.float32, length=5, block_tokens=4)
    with pytest.raises(KvHandoffError, match="shape"):
        encode_package(dataclasses.replace(package, k=package.k[:, :1]), "id")
    with pytest.raises(KvHandoffError, match="PackedKv"):
        encode_package(package.meta(), "id")  # a dict is not a package
    with pytest.raises(TypeError):
        decode_package(torch.zeros(4, dtype=torch.float32))


# ---------------------------------------------------------------------------------- 3. shm
def test_packages_of_every_size_from_two_processes_arrive_bit_exact(inbox_server, children):
    assert POISON_SLOTS  # released slots are overwritten here and in the children
    inbox, url = inbox_server()
    capacity = SlotLayout.from_dict(inbox.offer()["layout"]).request_slot_bytes - PAYLOAD_OFFSET
    sizes = [100, capacity, capacity + 1, 5 * capacity + 17, 40 * capacity]
    specs_a = [("bytes", n) for n in sizes] + [procs.EMPTY_KV]
    specs_b = [("bytes", 1 + (7 * i) % 300) for i in range(60)]  # back to back: slots reused
    senders = {
        1: (specs_a, children(procs.sender_main, url, 1, specs_a)[1]),
        2: (specs_b, children(procs.sender_main, url, 2, specs_b)[1]),
    }
    keys = {}
    for seed, (specs, conn) in senders.items():
        for _ in specs:
            _, i, cid, tag = recv(conn)
            keys[(seed, i)] = (cid, tag)
        assert recv(conn)[1] == {url: "shm"}
    # Many takers at once (as async handlers in worker threads would be).
    with ThreadPoolExecutor(8) as pool:
        got = dict(
            zip(keys, pool.map(lambda k: inbox.take(*k, DEADLINE_S), keys.values()), strict=True)
        )
    for (seed, i), data in got.items():
        spec = senders[seed][0][i]
        if tuple(spec) == procs.EMPTY_KV:
            back = decode_package(data, f"h{seed}-{i}")
            assert back.length == 0 and back.k.shape[1] == 0
        else:
            assert torch.equal(data, procs.pattern(seed, i, spec[1])), (seed, i)
    stats = inbox.stats
    assert stats["packages"] == len(keys) and stats["refused"] == 0 and stats["in_progress"] == 0


# ---------------------------------------------------------------------------------- 4. sender dies
def test_a_sender_killed_mid_package_fails_only_its_own_package(inbox_server, children):
    inbox, url = inbox_server()
    big = 64 << 20  # thousands of 4 KiB chunks: the sender is mid-package when it is killed
    victim, vconn = children(procs.sender_main, url, 3, [("bytes", 10), ("bytes", big)])
    _, _, cid, tag = recv(vconn)
    wait_until(lambda: inbox.stats["in_progress"] >= 1, "the big package started")
    t0 = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(PeerLostError, match="died"):
        inbox.take(cid, tag + 1, DEADLINE_S)
    assert time.monotonic() - t0 < LOSS_S
    assert torch.equal(inbox.take(cid, tag, DEADLINE_S), procs.pattern(3, 0, 10))  # complete
    # Another sender is served as before, and the inbox's thread lives on.
    specs = [("bytes", 3 * SLOT_BYTES + i) for i in range(5)]
    _, conn = children(procs.sender_main, url, 4, specs)
    for i in range(len(specs)):
        _, _, c, t = recv(conn)
        assert torch.equal(inbox.take(c, t, DEADLINE_S), procs.pattern(4, i, specs[i][1]))
    assert inbox.alive
    stats = inbox.stats
    assert stats["senders_lost"] == 1 and stats["in_progress"] == 0 and stats["connected"] == 1


# ---------------------------------------------------------------------------------- 5. decode dies
def test_a_dead_decode_side_fails_the_send_not_hangs(children):
    proc, conn = children(procs.inbox_main, SLOT_BYTES, SLOTS)
    url = recv(conn)
    outbox = KvOutbox("shm", timeout_s=DEADLINE_S)
    try:
        assert outbox.send(url, procs.pattern(5, 0, 100))[1] == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(DEADLINE_S)
        t0 = time.monotonic()
        with pytest.raises(KvTransferError, match=url) as err:  # the connection's peer is gone
            outbox.send(url, procs.pattern(5, 1, 20 * SLOT_BYTES))
        assert "PeerLost" in str(err.value)
        with pytest.raises(KvTransferError, match=url):  # reconnecting finds nobody
            outbox.send(url, procs.pattern(5, 2, 100))
        assert time.monotonic() - t0 < LOSS_S
        assert outbox.connected() == {}
    finally:
        outbox.close()


# ---------------------------------------------------------------------------------- 6. routes
def test_bad_connect_requests_get_400_with_the_reason(inbox_server):
    inbox, url = inbox_server()
    c = f"{url}/pd/kv/connect"
    ok = {"transport": "shm", "sender": "shm:moecomm-1-2-3-nothere", "client_id": 5}
    cases = [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "exactly the fields"),
        (json.dumps({"transport": "shm", "client_id": 5}).encode(), "exactly the fields"),
        (json.dumps({**ok, "client_id": "5"}).encode(), "'client_id' must be an integer"),
        (json.dumps({**ok, "client_id": True}).encode(), "'client_id' must be an integer"),
        (json.dumps({**ok, "client_id": -1}).encode(), "client_id must be in"),
        (json.dumps({**ok, "transport": "cuda_ipc"}).encode(), "not offered"),
        (json.dumps(ok).encode(), "cannot attach"),
    ]
    for body, words in cases:
        r = httpx.post(c, content=body, timeout=DEADLINE_S)
        assert r.status_code == 400, (body, r.text)
        assert words in r.json()["error"]["message"], (words, r.text)
    assert inbox.stats["connected"] == 0


def test_bad_disconnect_requests_get_400_and_unknown_clients_404(inbox_server):
    inbox, url = inbox_server()
    d = f"{url}/pd/kv/disconnect"
    cases = [
        (b"{not json", "not JSON"),
        (b"[5]", "exactly the fields ['client_id']"),
        (json.dumps({"client_id": 5, "extra": 1}).encode(), "exactly the fields"),
        (json.dumps({"client_id": "5"}).encode(), "'client_id' must be an integer"),
        (json.dumps({"client_id": True}).encode(), "'client_id' must be an integer"),
        (json.dumps({"client_id": -1}).encode(), "client_id must be in"),
        (json.dumps({"client_id": 1 << 64}).encode(), "client_id must be in"),
    ]
    for body, words in cases:
        r = httpx.post(d, content=body, timeout=DEADLINE_S)
        assert r.status_code == 400, (body, r.text)
        assert words in r.json()["error"]["message"], (words, r.text)
    with KvOutbox("shm") as out:
        cid, _ = out.send(url, procs.pattern(17, 0, 10))
        r = httpx.post(d, json={"client_id": cid + 1}, timeout=DEADLINE_S)
        assert r.status_code == 404 and "is not connected" in r.json()["error"]["message"]
        assert inbox.stats["connected"] == 1  # nobody else's connection was touched
        r = httpx.post(d, json={"client_id": cid}, timeout=DEADLINE_S)
        assert r.status_code == 200 and r.json() == {"client_id": cid, "disconnected": True}
        r = httpx.post(d, json={"client_id": cid}, timeout=DEADLINE_S)
        assert r.status_code == 404  # once
    assert inbox.stats["connected"] == 0 and inbox.stats["disconnected"] == 1


def test_a_server_without_an_inbox_answers_404(inbox_server):
    _, url = inbox_server(getter=lambda: None)
    for r in (
        httpx.get(f"{url}/pd/kv/offer", timeout=DEADLINE_S),
        httpx.post(f"{url}/pd/kv/connect", json={}, timeout=DEADLINE_S),
        httpx.post(f"{url}/pd/kv/disconnect", json={"client_id": 1}, timeout=DEADLINE_S),
    ):
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "this server takes no KV hand-offs"


def _raw_sender(url: str, client_id: int, claimed_id: int | None = None) -> StageSender:
    """A sender connected by hand, as a buggy or hostile prefill side would be; it may claim
    another client id at connect than the one its chunks carry."""
    offer = httpx.get(f"{url}/pd/kv/offer", timeout=DEADLINE_S).json()
    s = StageSender(
        ShmTransport(), SlotLayout.from_dict(offer["layout"]), client_id, offer["num_slots"]
    )
    claimed = client_id if claimed_id is None else claimed_id
    body = {"transport": "shm", "sender": s.handle, "client_id": claimed}
    r = httpx.post(f"{url}/pd/kv/connect", json=body, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    s.connect(r.json()["receiver"], r.json()["doorbell"])
    return s


# Payload bytes of one chunk of the test inboxes.
CAPACITY = kv_layout(SLOT_BYTES).request_slot_bytes - PAYLOAD_OFFSET


def _refused_at_once(act, words: str, error=RemoteError) -> None:
    """`act()` raises `error` naming the broken rule (`words`) within REFUSAL_S."""
    t0 = time.monotonic()
    with pytest.raises(error, match=words):
        act()
    assert time.monotonic() - t0 < REFUSAL_S, f"{words!r}: refused only at the deadline"


def _send_chunks(sender: StageSender, chunks, piece: torch.Tensor):
    """Writes chunks (tag, index, count) as a buggy sender would, each acknowledged before the
    next (a connection has fewer slots than some of these lists have chunks)."""
    for tag, index, count in chunks:
        sender.send_chunk(tag, index, count, piece)
        sender.flush(DEADLINE_S)


def test_a_sender_breaking_a_rule_gets_the_rule_at_once_and_others_are_served(inbox_server):
    max_chunks = 4
    inbox, url = inbox_server(max_package_bytes=max_chunks * CAPACITY)
    piece = torch.arange(16, dtype=torch.uint8)
    # A second connect with a live sender's id is refused.
    dup = _raw_sender(url, 77)
    body = {"transport": "shm", "sender": dup.handle, "client_id": 77}
    r = httpx.post(f"{url}/pd/kv/connect", json=body, timeout=DEADLINE_S)
    assert r.status_code == 400 and "already connected" in r.text
    # Each sender breaks one rule: (client id, its chunks (tag, index, count), words of the
    # reason it gets, a package of it that will not come).
    cases = [
        (70, [(1, 0, 2), (2, 0, 1)], "package 2 chunk 0/1 while package 1 .* one package at a", 1),
        (71, [(1, 0, 2), (1, 0, 2)], "package 1 chunk 0 came twice", 1),
        (72, [(1, 0, 1), (1, 0, 1)], "package 1 after package 1: tags go up", 2),
        (73, [(1, 0, 1), (5, 0, 2), (5, 1, 2), (3, 0, 1)], "package 3 after package 5", 3),
        (74, [(1, 0, max_chunks + 1)], f"of {max_chunks + 1} chunks exceeds the {max_chunks}", 1),
    ]
    senders = [dup]
    for cid, chunks, words, lost in cases:
        s = _raw_sender(url, cid)
        senders.append(s)
        _refused_at_once(lambda s=s, chunks=chunks: _send_chunks(s, chunks, piece), words)
        with pytest.raises(KvTransferError, match=f"refused.*{words}"):
            inbox.take(cid, lost, DEADLINE_S)
    # What a refused sender completed before is kept.
    assert torch.equal(inbox.take(72, 1, DEADLINE_S), piece)
    assert torch.equal(inbox.take(73, 1, DEADLINE_S), piece)
    assert torch.equal(inbox.take(73, 5, DEADLINE_S), torch.cat([piece, piece]))
    # A chunk under another client id than its connection's: the sender gets that reason too
    # (the refusal is answered under the id the chunk carries).
    bad = _raw_sender(url, 78, claimed_id=80)
    senders.append(bad)
    _refused_at_once(
        lambda: _send_chunks(bad, [(1, 0, 1)], piece),
        "client id is not the owner of this slot \\(the chunk says 78, this channel's is 80\\)",
    )
    with pytest.raises(KvTransferError, match="refused"):
        inbox.take(80, 1, DEADLINE_S)
    # Through a KvOutbox: a package above the inbox's largest fails the send with the reason,
    # ...
    with KvOutbox("shm") as out:
        too_big = procs.pattern(9, 1, max_chunks * CAPACITY + 1)
        _refused_at_once(
            lambda: out.send(url, too_big), "exceeds the 4 chunks", error=KvTransferError
        )
        assert out.connected() == {}
        # ... and so does a tag used twice (an outbox bug, forced here).
        cid, tag = out.send(url, procs.pattern(9, 2, 10))
        out._peers[url].next_tag = tag
        _refused_at_once(
            lambda: out.send(url, procs.pattern(9, 3, 10)), "tags go up", error=KvTransferError
        )
        # Everyone else is served, this outbox too (on a new connection).
        cid, tag = out.send(url, procs.pattern(9, 4, 999))
        assert tag == 1 and torch.equal(inbox.take(cid, tag, DEADLINE_S), procs.pattern(9, 4, 999))
    assert inbox.alive and inbox.stats["refused"] == len(cases) + 3
    for s in senders:
        s.close()


def test_a_connection_the_outbox_drops_is_freed_at_the_decode_side(inbox_server, monkeypatch):
    inbox, url = inbox_server()
    out = KvOutbox("shm")
    answers = []
    call = out._call

    def recording_call(method, u, deadline, body=None):
        answers.append(call(method, u, deadline, body))
        return answers[-1]

    monkeypatch.setattr(out, "_call", recording_call)
    try:
        cid, tag = out.send(url, procs.pattern(16, 0, 10))
        segment = Path("/dev/shm") / answers[-1]["receiver"].removeprefix("shm:")
        assert segment.exists()
        sender = out._peers[url].sender

        def half_then_fail(tag, data, timeout, encoding=None):
            """A send that runs out of time after its first chunk was taken."""
            sender.send_chunk(tag, 0, 3, data[:100], encoding)
            sender.flush(timeout)
            wait_until(lambda: inbox.stats["in_progress_bytes"] == 100, "the first chunk held")
            raise DeadlineExceededError("out of time mid-package (forced)")

        monkeypatch.setattr(sender, "send", half_then_fail)
        with pytest.raises(KvTransferError, match="forced"):
            out.send(url, procs.pattern(16, 1, 3 * SLOT_BYTES))
        # The outbox said so before send() returned: the connection and what it held are gone.
        assert out.connected() == {}
        stats = inbox.stats
        assert stats["connected"] == 0 and stats["disconnected"] == 1, stats
        assert stats["in_progress"] == 0 and stats["in_progress_bytes"] == 0, stats
        assert not segment.exists()
        with pytest.raises(KvTransferError, match="its sender dropped the connection"):
            inbox.take(cid, tag + 1, DEADLINE_S)
        # A complete package of that connection stays until taken.
        assert torch.equal(inbox.take(cid, tag, DEADLINE_S), procs.pattern(16, 0, 10))
        # Closing the outbox drops (and frees) its connections too.
        again = out.send(url, procs.pattern(16, 2, 10))
        assert again[0] != cid and inbox.stats["connected"] == 1
    finally:
        out.close()
    assert inbox.stats["connected"] == 0 and inbox.stats["disconnected"] == 2
    assert torch.equal(inbox.take(*again, DEADLINE_S), procs.pattern(16, 2, 10))


# ---------------------------------------------------------------------------------- 7. nixl
def test_nixl_carries_packages_between_network_namespaces(tmp_path):
    from moecomm import netns
    from moecomm.wire.nixl import available as nixl_available

    lab_ok, lab_why = netns.available()
    nixl_ok, nixl_why = nixl_available()
    if not lab_ok:
        pytest.skip(f"network namespaces cannot be made: {lab_why}")
    if not nixl_ok:
        pytest.skip(f"NIXL is not installed: {nixl_why}")
    from lab_procs import start_logged, wait_for_log

    script = str(Path(procs.__file__).resolve())
    sizes = [10, 3 * SLOT_BYTES + 5, 200_000]
    with netns.Lab() as lab:
        a, b = lab.add_host("kva"), lab.add_host("kvb")
        port = 8700
        common = {"slot_bytes": SLOT_BYTES, "sent": str(tmp_path / "sent.json")}
        common["out"] = str(tmp_path / "out.json")
        cfg_b = {**common, "host": b.addr, "port": port}
        cfg_a = {**common, "host": a.addr, "url": f"http://{b.addr}:{port}", "seed": 11}
        cfg_a["sizes"] = sizes
        for name, cfg in (("b", cfg_b), ("a", cfg_a)):
            (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
        deadline = time.monotonic() + 120
        py = [sys.executable, "-X", "faulthandler", script]
        logs = {n: tmp_path / f"{n}.log" for n in "ab"}
        inbox = start_logged(lab, b, [*py, "ns-inbox", str(tmp_path / "b.json")], logs["b"])
        wait_for_log(logs["b"], "kv inbox listening", inbox, deadline)
        sender = start_logged(lab, a, [*py, "ns-sender", str(tmp_path / "a.json")], logs["a"])
        wait_for_log(logs["a"], "kv sender done", sender, deadline)
        assert inbox.wait(timeout=60) == 0, logs["b"].read_text()[-3000:]
    sent = json.loads(Path(common["sent"]).read_text())
    out = json.loads(Path(common["out"]).read_text())
    assert sent["transports"] == {cfg_a["url"]: "nixl"}  # auto, across hosts: nixl
    assert out["hashes"] == [procs.sha(procs.pattern(11, i, n)) for i, n in enumerate(sizes)]
    assert out["stats"]["packages"] == len(sizes)


# ---------------------------------------------------------------------------------- 8. ttl
def test_an_unclaimed_package_expires_and_is_counted(inbox_server):
    ttl = 0.3
    inbox, url = inbox_server(ttl_s=ttl)
    with KvOutbox("shm") as out:
        cid, tag = out.send(url, procs.pattern(12, 0, 5000))
        kept = out.send(url, procs.pattern(12, 1, 10))
        assert torch.equal(inbox.take(*kept, DEADLINE_S), procs.pattern(12, 1, 10))
        wait_until(lambda: inbox.stats["expired"] == 1, "the unclaimed package expired")
        with pytest.raises(DeadlineExceededError):
            inbox.take(cid, tag, 0.2)
        # The connection itself lives on.
        again = out.send(url, procs.pattern(12, 2, 10))
        assert torch.equal(inbox.take(*again, DEADLINE_S), procs.pattern(12, 2, 10))


def test_take_waits_for_a_package_sent_later_and_many_may_wait(inbox_server):
    inbox, url = inbox_server()
    with KvOutbox("shm") as out:
        first = out.send(url, procs.pattern(13, 0, 10))
        cid = first[0]
        results = {}

        def waiter(tag):
            results[tag] = inbox.take(cid, tag, DEADLINE_S)

        threads = [threading.Thread(target=waiter, args=(t,)) for t in (2, 3, 4)]
        for t in threads:
            t.start()
        for i in (1, 2, 3):
            out.send(url, procs.pattern(13, i, 100 * i))
        for t in threads:
            t.join(DEADLINE_S)
        for tag in (2, 3, 4):
            assert torch.equal(results[tag], procs.pattern(13, tag - 1, 100 * (tag - 1)))
        assert inbox.stats["packages"] == 4


def test_one_outbox_sends_to_two_decode_sides_in_parallel(inbox_server):
    (inbox_a, url_a), (inbox_b, url_b) = inbox_server(), inbox_server()
    specs = {url_a: (inbox_a, 14), url_b: (inbox_b, 15)}
    with KvOutbox("shm") as out:

        def burst(url):
            inbox, seed = specs[url]
            for i in range(10):
                key = out.send(url, procs.pattern(seed, i, 2 * SLOT_BYTES + i))
                assert torch.equal(
                    inbox.take(*key, DEADLINE_S), procs.pattern(seed, i, 2 * SLOT_BYTES + i)
                )
            return key[1]

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(burst, specs)) == [10, 10]  # tags count up per connection
        assert out.connected() == {url_a: "shm", url_b: "shm"}
