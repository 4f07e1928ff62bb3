"""The protocol demo (`make demo`): one client and one identity expert server in two processes,
talking through shared-memory slots. Prints each step of the protocol as it happens."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from moecomm import _C
from moecomm.errors import ProtocolError, RemoteError
from moecomm.testing import make_pattern, spawn_identity_server
from moecomm.wire.client import ClientChannel
from moecomm.wire.protocol import SlotLayout, signal_seq, signal_state
from moecomm.wire.shm import ShmTransport, list_segments

CLIENT_ID = 1
SEED = 0


def _say(msg: str) -> None:
    print(msg, flush=True)


def run(max_tokens: int, hidden: int, topk: int, rounds: int) -> int:
    layout = SlotLayout(max_tokens=max_tokens, hidden=hidden, topk=topk)
    _say(
        f"slot layout: max_tokens={max_tokens} hidden={hidden} topk={topk} bf16 -> "
        f"request slot {layout.request_slot_bytes} B, response slot {layout.response_slot_bytes} B"
    )
    transport = ShmTransport()
    client = ClientChannel(transport, layout, CLIENT_ID, num_slots=2)
    _say(f"client: response region {client.handle} ({client.region.size} B, mode 0600)")
    server = spawn_identity_server(layout, CLIENT_ID, num_slots=2)
    _say(f"server: pid {server.process.pid}, request region {server.handle}")
    failures = 0
    try:
        client.connect(server.handle)
        server.connect(client.handle)
        _say("handshake: both sides attached to each other's region")
        gen = torch.Generator().manual_seed(SEED)
        # Double-batch overlap: two micro-batches in flight on alternating slots.
        for r in range(rounds):
            sent = []
            for slot in (0, 1):
                n = 1 + (r * 2 + slot) * (max_tokens - 1) // max(1, 2 * rounds - 1)
                x, ids, scores, _ = make_pattern(CLIENT_ID, client.peek_seq(), n, layout, gen)
                t0 = time.perf_counter_ns()
                got_seq = client.send(slot, x, ids, scores, layer_id=r)
                sent.append((slot, got_seq, x, t0))
                _say(f"  round {r} slot {slot}: sent seq {got_seq}, {n} tokens, layer {r}")
            for slot, seq, x, t0 in sent:
                resp = client.wait(slot, seq, timeout=10.0)
                us = (time.perf_counter_ns() - t0) / 1e3
                word = transport.load(client.region, client.response_ring.slot_offset(slot))
                ok = torch.equal(resp.activations, x)
                failures += not ok
                _say(
                    f"  round {r} slot {slot}: response seq {signal_seq(word)} "
                    f"state {signal_state(word).name}, {resp.num_tokens} tokens, "
                    f"{'bit-exact' if ok else 'MISMATCH'}, {us:.0f} us"
                )
        # A request whose payload does not match its header pattern is answered with an error.
        x, ids, scores, _ = make_pattern(CLIENT_ID, client.peek_seq(), 2, layout, gen)
        ids[0, 0] = -1
        s = client.send(0, x, ids, scores)
        try:
            client.wait(0, s, timeout=10.0)
            _say("  corrupted request: UNEXPECTEDLY ACCEPTED")
            failures += 1
        except RemoteError as e:
            _say(f"  corrupted request seq {s}: rejected by the server ({e.reason})")
        # A request larger than the slot is refused before anything is written.
        big = torch.zeros(max_tokens + 1, hidden, dtype=torch.bfloat16)
        try:
            client.send(
                1,
                big,
                torch.zeros(max_tokens + 1, topk, dtype=torch.int32),
                torch.zeros(max_tokens + 1, topk),
            )
            failures += 1
        except ValueError as e:
            _say(f"  oversized request: refused locally ({str(e).split(' (')[0]})")
    except (ProtocolError, RemoteError, TimeoutError) as e:
        _say(f"error: {e}")
        failures += 1
    finally:
        stats = server.stop()
        client.close()
    _say(f"server stopped: {stats}")
    left = list_segments(server.process.pid) + list_segments(os.getpid())
    _say(f"segments left behind: {left or 'none'}")
    _say("demo " + ("OK" if failures == 0 and not left else f"FAILED ({failures} failures)"))
    return 0 if failures == 0 and not left else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    _ = _C  # the native module must import even on a machine without a GPU
    return run(a.max_tokens, a.hidden, a.topk, a.rounds)


if __name__ == "__main__":
    sys.exit(main())
