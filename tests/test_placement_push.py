"""Placement epochs pushed, not read (issue 30, item 2): a ServerPlacement in its own process,
over its own NIXL agent, writes every epoch change into the word a client handed it
(subscribe); the client learns each change by loading its own memory, with no transfer of its
own. A second subscription replaces the first, forget() stops the pushes, and a client that
misses a push still has the stale-map rule (not exercised here: placement tests cover it).
Seeds are fixed; deadlines are seconds."""

from __future__ import annotations

import time

import moecomm.wire.nixl
import pytest
import torch
from moecomm.runtime.experts import ExpertWeights
from moecomm.runtime.registry import ClientRegistry
from moecomm.runtime.server_placement import EpochWord, ServerPlacement
from nixl_helpers import NIXL_OK, NIXL_WHY, SEED, recv, spawn

pytestmark = [
    pytest.mark.skipif(not NIXL_OK, reason=f"NIXL is not installed: {NIXL_WHY}"),
    pytest.mark.timeout(120),
]

HIDDEN, INTERMEDIATE = 16, 8
LAYER = 0
# A pushed epoch is in the client's memory well within this (one notification across the
# host); generous for a shared 2-core machine.
PUSH_DEADLINE_S = 10.0
CHANGES = 5


def _placement_server(conn):
    """A ServerPlacement over nixl that adds an expert per "add" command and reports the epoch;
    ("subscribe", id, handle) and ("forget", id) are passed through."""
    t = moecomm.wire.nixl.open_nixl_transport()
    g = torch.Generator().manual_seed(SEED)
    placement = ServerPlacement({}, HIDDEN, t, ClientRegistry("push-test"))
    conn.send(placement.epoch)
    expert = 0
    while (cmd := conn.recv())[0] != "stop":
        if cmd[0] == "subscribe":
            placement.subscribe(cmd[1], t, cmd[2])
            conn.send(placement.subscribers())
        elif cmd[0] == "forget":
            placement.forget(cmd[1])
            conn.send(placement.subscribers())
        elif cmd[0] == "add":
            w = ExpertWeights(
                torch.randn(INTERMEDIATE, HIDDEN, generator=g),
                torch.randn(INTERMEDIATE, HIDDEN, generator=g),
                torch.randn(HIDDEN, INTERMEDIATE, generator=g),
            )
            conn.send(placement.add(LAYER, expert, w)["epoch"])
            expert += 1
    placement.close()
    conn.send("bye")


def _until(word: EpochWord, want: int) -> int:
    """Loads our own word until it holds `want`; returns it (or the last value at the deadline)."""
    deadline = time.monotonic() + PUSH_DEADLINE_S
    v = word.read()
    while v != want and time.monotonic() < deadline:
        time.sleep(1e-4)
        v = word.read()
    return v


def test_every_epoch_change_is_pushed_into_the_client_word(reaper):
    _p, conn, first = spawn(reaper, _placement_server)
    t = moecomm.wire.nixl.open_nixl_transport()
    word = EpochWord(t)
    assert word.read() == 0  # nothing pushed yet
    conn.send(("subscribe", 7, word.handle))
    assert recv(conn) == [7]
    assert _until(word, first) == first  # the current epoch at once
    reads = t.engine.transfers_by_op["READ"]
    for _ in range(CHANGES):
        conn.send(("add",))
        epoch = recv(conn)
        assert _until(word, epoch) == epoch
    # Each change took one signal from the server and no transfer from us: we only loaded.
    assert t.engine.transfers_by_op["READ"] == reads
    assert t.engine.notifications_received >= CHANGES

    # A second word replaces the first: the old one is no longer written.
    fresh = EpochWord(t)
    conn.send(("subscribe", 7, fresh.handle))
    assert recv(conn) == [7]
    assert _until(fresh, epoch) == epoch
    conn.send(("add",))
    epoch = recv(conn)
    assert _until(fresh, epoch) == epoch
    assert word.read() == epoch - 1

    # forget (the client left): no more pushes.
    conn.send(("forget", 7))
    assert recv(conn) == []
    conn.send(("add",))
    later = recv(conn)
    assert later == epoch + 1
    time.sleep(0.2)  # a push, had there been one, lands well within this
    assert fresh.read() == epoch
    conn.send(("stop",))
    assert recv(conn) == "bye"
