"""KV pools over an engine's own tensors (moecomm.wire.kv with ``tensors=``): a peer on the same
host writes them straight into the owning process (process_vm_writev) while completion words
and liveness stay in shared memory. Two real processes, both vLLM tensor layouts (blocks
contiguous and strided), engine tensors on either side or both, bit-exact KV; the tensors
checked against the layout; a peer on another host, a writer the kernel refuses, a wild
address, fuzzed pool descriptions and poisoned words each a clear error on both sides; either
end killed mid-transfer."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import random
import time

import pytest
import torch
from kv_helpers import (
    DEATH_NOTICE_S,
    RECEIVER_BLOCKS,
    SEED,
    SENDER_BLOCKS,
    WAIT_S,
    Peer,
    assert_blocks_equal,
    layout,
    reference,
)
from kv_peer_proc import engine_tensors, fill, write_as
from moecomm import prefork
from moecomm.errors import DeadlineExceededError, PeerLostError, ProtocolError, RemoteError
from moecomm.wire.kv import (
    SEQ_SHIFT,
    BlockTransferError,
    KvPool,
    KvPoolInfo,
    KvState,
    cma,
)
from moecomm.wire.shm import ShmTransport, list_segments, reap_stale_segments

PR_SET_DUMPABLE = 4
# A reservation of address space with no access (PROT_NONE): a write anywhere in it is refused
# by the kernel (EFAULT) and corrupts nothing, which a made-up address cannot promise. Large
# enough for every block of a fuzzed pool at the largest stride the fuzzing uses.
GUARD_BYTES = 64 << 20
FUZZ_STRIDE = 1 << 20
PROT_NONE, MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0, 0x02, 0x20, 0x4000


@pytest.fixture(scope="module")
def guard():
    """The address of a PROT_NONE reservation of GUARD_BYTES in this process."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
    address = libc.mmap(None, GUARD_BYTES, PROT_NONE, flags, -1, 0)
    assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    yield address
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap(address, GUARD_BYTES)


@pytest.fixture
def transport():
    return ShmTransport()


def engine_pool(transport, num_blocks: int, kind: str = "blocks_inner") -> KvPool:
    lay = layout(num_blocks)
    return KvPool(transport, lay, tensors=engine_tensors(lay, kind))


@pytest.mark.parametrize("kind", ["blocks_inner", "blocks_outer"])
@pytest.mark.parametrize("sender_tensors", [False, True])
def test_engine_tensors_receive_bit_exact_from_another_process(transport, kind, sender_tensors):
    """The receiver registers its own tensors (both vLLM layouts); the sender in another
    process (library pool or engine tensors too) writes straight into them."""
    pool = engine_pool(transport, RECEIVER_BLOCKS, kind)
    assert pool.info().memory == "process" and pool.data is None
    peer = Peer(SENDER_BLOCKS, SEED, "blocks_outer" if sender_tensors else "")
    ref = reference(SEED, SENDER_BLOCKS)
    try:
        link = pool.connect(peer.info)
        peer.call("connect", pool.info().to_json())
        rng = random.Random(5)
        for n in (1, 7, SENDER_BLOCKS):
            src, dst = rng.sample(range(SENDER_BLOCKS), n), rng.sample(range(RECEIVER_BLOCKS), n)
            with link.expect(dst) as recv:
                peer.call("send", recv.request.to_json(), src)
                recv.wait(WAIT_S)
                assert recv.poll() == KvState.DONE
                assert_blocks_equal(pool, dst, ref, src)
        # The engine's own tensors hold the KV (the views are those tensors).
        for i, p in enumerate(pool.layout.parts):
            assert pool.view(p.layer, p.name) is pool.tensors[i]
        # Layer by layer: layer 1 first; layer 0's blocks untouched until it is sent.
        src, dst = list(range(4, 12)), list(range(30, 38))
        with link.expect(dst) as recv:
            before = pool.view(0, "k")[dst].clone()
            seq = peer.call("start", recv.request.to_json(), src)
            peer.call("layer", seq, 1)
            recv.wait_layer(1, WAIT_S)
            assert_blocks_equal(pool, dst, ref, src, layers=[1])
            assert torch.equal(pool.view(0, "k")[dst], before)
            assert recv.poll() == KvState.TRANSFERRING
            peer.call("layer", seq, 0)
            peer.call("finish", seq)
            recv.wait(WAIT_S)
            assert_blocks_equal(pool, dst, ref, src)
        link.close()
    finally:
        ref.close()
        peer.close()
        pool.close()
    assert not list_segments(peer.proc.pid), "the peer's shm segments outlived it"


def test_engine_tensors_send_into_a_peer_pool(transport):
    """The sending side registers its engine tensors; the receiver in another process is an
    engine pool too (one process_vm_writev per layer)."""
    pool = engine_pool(transport, SENDER_BLOCKS, "blocks_outer")
    fill(pool, SEED)
    ref = reference(SEED, SENDER_BLOCKS)
    peer = Peer(RECEIVER_BLOCKS, SEED + 1, "blocks_inner")
    try:
        peer.call("connect", pool.info().to_json())
        link = pool.connect(peer.info)
        request = peer.call("expect", [3, 9, 10, 11])
        link.send(request, [20, 0, 1, 2])
        peer.call("wait", json.loads(request)["seq"], WAIT_S)
        # Back the other way into our engine tensors: what arrived there is what we sent.
        with link.expect([0, 1, 2, 3]) as recv:
            peer.call("send", recv.request.to_json(), [3, 9, 10, 11])
            recv.wait(WAIT_S)
            assert_blocks_equal(pool, [0, 1, 2, 3], ref, [20, 0, 1, 2])
        link.close()
    finally:
        peer.close()
        ref.close()
        pool.close()


def test_engine_tensors_are_checked_against_the_layout(transport):
    lay = layout(4)
    good = engine_tensors(lay, "blocks_inner")
    cases = [
        (good[:3], "3 tensors for 4 parts"),
        ([*good[:3], good[3].to(torch.float16)], "layout says"),
        ([*good[:3], good[3][:2]], "layout says"),
        ([*good[:3], good[3].transpose(1, 2)], "layout says"),
        ([*good[:3], good[3].permute(0, 1, 3, 2).contiguous().transpose(2, 3)], "not contiguous"),
        ([*good[:3], torch.zeros(4, 2, 4, 96, dtype=torch.bfloat16, device="meta")], "meta"),
        ([*good[:3], "not a tensor"], "not a torch.Tensor"),
    ]
    for tensors, why in cases:
        with pytest.raises(BlockTransferError, match=why):
            KvPool(transport, lay, tensors=tensors)
    # Blocks that overlap (stride smaller than a block) are refused too.
    flat = torch.zeros(4 * 2 * 4 * 96 + 96, dtype=torch.bfloat16)
    overlapping = flat.as_strided((4, 2, 4, 96), (96, 4 * 96, 96, 1))
    with pytest.raises(BlockTransferError, match="not contiguous and disjoint"):
        KvPool(transport, lay, tensors=[*good[:3], overlapping])


def test_engine_pool_across_hosts_is_refused(transport):
    pool = engine_pool(transport, RECEIVER_BLOCKS)
    other = KvPool(transport, layout(SENDER_BLOCKS))
    try:
        d = json.loads(pool.info().to_json())
        d["host"] = "another-boot-id/pid:[1]"
        with pytest.raises(BlockTransferError, match="both pools on one host"):
            other.connect(json.dumps(d))
        d = json.loads(other.info().to_json())
        d["host"] = "another-boot-id/pid:[1]"
        with pytest.raises(BlockTransferError, match="both pools on one host"):
            pool.connect(json.dumps(d))
        # Two library pools need no pid: they connect whatever the host field says.
        other.connect(json.dumps(d)).close()
    finally:
        other.close()
        pool.close()


def _write_from_child(pid: int, address: int, nbytes: int, drop: bool):
    ctx = prefork.process_context()
    a, b = ctx.Pipe()
    p = ctx.Process(target=write_as, args=(b, pid, address, nbytes, drop))
    p.start()
    try:
        assert a.poll(60), "the writer did not answer"
        return a.recv()
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(10)


class _Undumpable:
    """This process refuses ptrace-mode access from same-uid non-root processes while inside
    (how a test makes the kernel refuse a writer when it cannot drop privileges)."""

    def __enter__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        self.prctl = libc.prctl
        assert self.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0

    def __exit__(self, *exc):
        self.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)


def test_cma_refusals_are_clear(guard):
    """The kernel's refusals name themselves: a process that may not write ours (EPERM), an
    address we do not map (EFAULT), a process that is gone (ESRCH -> PeerLostError)."""
    target = torch.zeros(64, dtype=torch.uint8)
    root = os.geteuid() == 0
    if root:
        kind, err, msg = _write_from_child(os.getpid(), target.data_ptr(), 64, drop=True)
    else:
        with _Undumpable():
            kind, err, msg = _write_from_child(os.getpid(), target.data_ptr(), 64, drop=False)
    assert (kind, err) == ("CmaError", errno.EPERM), msg
    assert "may not write the receiver's memory" in msg
    assert not target.any(), "a refused write changed our memory"
    kind, err, msg = _write_from_child(os.getpid(), guard, 64, drop=False)
    assert (kind, err) == ("CmaError", errno.EFAULT), msg
    # A pid that exited (its child reaped): nobody has it until pids wrap.
    ctx = prefork.process_context()
    gone = ctx.Process(target=time.sleep, args=(0,))
    gone.start()
    gone.join(30)
    with pytest.raises(PeerLostError, match="is gone"):
        cma.write(gone.pid, [(target.data_ptr(), target.data_ptr(), 8)])


def test_refused_writer_fails_both_sides(transport):
    """A sender the kernel does not let write our tensors raises there, and the receiver's
    wait fails at once with the sender's reason (no deadline); the slot is freed."""
    pool = engine_pool(transport, RECEIVER_BLOCKS)
    peer = Peer(SENDER_BLOCKS, SEED)
    pid = peer.proc.pid
    try:
        link = pool.connect(peer.info)
        peer.call("connect", pool.info().to_json())
        before = pool.view(0, "k").clone()
        recv = link.expect([1, 2])
        if os.geteuid() == 0:
            peer.call("drop_privileges")
            err = _send_error(peer, recv)
        else:
            with _Undumpable():
                err = _send_error(peer, recv)
        assert "CmaError" in err and "EPERM" in err, err
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="EPERM"):
            recv.wait(WAIT_S)
        assert time.monotonic() - t0 < WAIT_S / 2
        assert recv.poll() == KvState.FAILED
        assert torch.equal(pool.view(0, "k"), before)
        recv.release()
        link.expect([1, 2]).release()  # the blocks and the slot are free again
        link.close()
    finally:
        peer.kill()  # a sender that dropped privileges cannot unlink its root-owned segments
        reap_stale_segments(pid)
        pool.close()
    assert not list_segments(pid)


def _send_error(peer: Peer, recv) -> str:
    with pytest.raises(RuntimeError) as info:
        peer.call("send", recv.request.to_json(), [0, 1])
    return str(info.value)


def test_wild_address_fails_both_sides(transport, guard):
    """A pool description with an address the receiver cannot be written at: the kernel
    refuses the write there (and writes nothing else past it), the sender raises, the
    receiver's transfer FAILED with the sender's reason."""
    sender = KvPool(transport, layout(SENDER_BLOCKS))
    receiver = engine_pool(transport, RECEIVER_BLOCKS)
    try:
        d = json.loads(receiver.info().to_json())
        d["addresses"][1] = [guard, d["addresses"][1][1]]
        recv_link, send_link = receiver.connect(sender.info()), sender.connect(json.dumps(d))
        recv = recv_link.expect([0])
        with pytest.raises(cma.CmaError, match=r"EFAULT|wrote \d+ of"):
            send_link.send(recv.request, [0])
        with pytest.raises(RemoteError, match=r"EFAULT|wrote \d+ of"):
            recv.wait(WAIT_S)
        recv.release()
        send_link.close()
        recv_link.close()
    finally:
        receiver.close()
        sender.close()


def test_fuzzed_engine_pool_descriptions(transport, guard):
    """Seeded mutations of an engine pool's description (pid, host, memory, addresses): each is
    refused with BlockTransferError, or connects and then either moves the blocks bit-exact or
    fails the transfer on both sides; never anything else."""
    receiver = engine_pool(transport, RECEIVER_BLOCKS)
    sender = KvPool(transport, layout(SENDER_BLOCKS))
    fill(sender, SEED)
    rng = random.Random(77)
    junk = [-1, 0, 2**64, 3.5, "x", None, [], {}, True, [[1, 2]], [[guard, FUZZ_STRIDE]] * 4]
    info = json.loads(receiver.info().to_json())
    recv_link = receiver.connect(sender.info())
    outcomes = {"refused": 0, "served": 0, "failed": 0}
    try:
        for _ in range(150):
            d = json.loads(json.dumps(info))
            key = rng.choice(["pid", "host", "memory", "addresses", "addresses", "data"])
            if key == "addresses" and rng.random() < 0.5:
                i = rng.randrange(len(d["addresses"]))
                j = rng.randrange(2)
                # An address in the guard, or a stride shorter than a block.
                d["addresses"][i][j] = guard if j == 0 else rng.choice([0, 1, 64])
            else:
                d[key] = rng.choice(junk)
            try:
                send_link = sender.connect(json.dumps(d))
            except BlockTransferError:
                outcomes["refused"] += 1
                continue
            recv = recv_link.expect(rng.sample(range(RECEIVER_BLOCKS), 2))
            src = rng.sample(range(SENDER_BLOCKS), 2)
            try:
                send_link.send(recv.request, src)
            except (BlockTransferError, PeerLostError):
                with pytest.raises((RemoteError, DeadlineExceededError)):
                    recv.wait(0.05)
                outcomes["failed"] += 1
            else:
                recv.wait(WAIT_S)
                assert_blocks_equal(receiver, list(recv.dst), sender, src)
                outcomes["served"] += 1
            recv.release()
            send_link.close()
        assert outcomes["refused"] and outcomes["served"], outcomes
    finally:
        recv_link.close()
        sender.close()
        receiver.close()


def test_poisoned_words_of_an_engine_pool(transport):
    """The completion words of an engine pool live in shm like any pool's: garbage there is
    never taken for completion."""
    pool = engine_pool(transport, RECEIVER_BLOCKS)
    other = KvPool(transport, layout(SENDER_BLOCKS))
    rng = random.Random(3)
    try:
        link = pool.connect(other.info())
        g = pool.geometry
        for _ in range(30):
            recv = link.expect([1])
            ours = rng.random() < 0.5
            garbage = (recv.seq << SEQ_SHIFT) | rng.choice([0, 4, 255]) if ours else 1 << 60 | 2
            transport.signal(pool.control, g.status(recv.slot), garbage)
            with pytest.raises(ProtocolError if ours else DeadlineExceededError):
                recv.wait(0.03)
            recv.release()
        link.close()
    finally:
        other.close()
        pool.close()


def test_killed_receiver_of_engine_tensors(transport):
    """The receiving engine dies between two layers: the sender's next cross-memory write
    raises PeerLostError (not a hang, not a crash)."""
    sender = KvPool(transport, layout(SENDER_BLOCKS))
    peer = Peer(RECEIVER_BLOCKS, SEED, "blocks_inner")
    pid = peer.proc.pid
    try:
        peer.call("connect", sender.info().to_json())
        link = sender.connect(peer.info)
        send = link.start(peer.call("expect", [0, 1]), [2, 3])
        send.layer(0)
        peer.kill()
        with pytest.raises(PeerLostError, match="receiving process died"):
            send.layer(1)
        link.close()
    finally:
        peer.close()
        sender.close()
    assert not list_segments(pid), "the dead receiver's segments were not reaped"


def test_killed_sender_into_engine_tensors(transport):
    pool = engine_pool(transport, RECEIVER_BLOCKS)
    peer = Peer(SENDER_BLOCKS, SEED)
    pid = peer.proc.pid
    try:
        link = pool.connect(peer.info)
        peer.call("connect", pool.info().to_json())
        with link.expect([4, 5]) as recv:
            seq = peer.call("start", recv.request.to_json(), [0, 1])
            peer.call("layer", seq, 0)
            recv.wait_layer(0, WAIT_S)
            peer.kill()
            t0 = time.monotonic()
            with pytest.raises(PeerLostError, match="sending process died"):
                recv.wait(WAIT_S)
            assert time.monotonic() - t0 < DEATH_NOTICE_S
        with link.expect([4, 5]) as again:  # freed: reserved again at once
            assert again.poll() in (KvState.WAITING, KvState.FAILED)
        link.close()
    finally:
        peer.close()
        pool.close()
    assert not list_segments(pid)


def test_pool_info_json_stays_compatible():
    """A description without the new fields (an older peer) still parses, as a library pool;
    ours round-trips."""
    lay = layout(4)
    old = {
        "version": 1,
        "transport": "shm",
        "data": "shm:a",
        "control": "shm:b",
        "doorbell": "shm:c",
        "max_transfers": 4,
        "layout": lay.to_dict(),
    }
    info = KvPoolInfo.from_json(json.dumps(old))
    assert (info.memory, info.pid, info.addresses) == ("region", 0, ())
    d = dict(old, pid=123, host="h", memory="process", addresses=[[4096 * 16, 3072]] * 4)
    back = KvPoolInfo.from_json(KvPoolInfo.from_json(json.dumps(d)).to_json())
    assert back.addresses == ((4096 * 16, 3072),) * 4 and back.pid == 123
    for bad in (
        dict(d, memory="gpu"),
        dict(d, pid=0),
        dict(d, addresses=[[4096 * 16, 3072]] * 3),
        dict(d, addresses=[[4096 * 16, 100]] * 4),
        dict(d, addresses=[[2**64 - 4096, 3072]] * 4),
        dict(old, addresses=[[4096 * 16, 3072]] * 4),
    ):
        with pytest.raises(BlockTransferError):
            KvPoolInfo.from_json(json.dumps(bad))
