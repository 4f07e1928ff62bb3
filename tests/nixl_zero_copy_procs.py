"""The spawned peers of tests/wire/test_nixl_zero_copy.py, each with its own NIXL agent: a
receiver that reports what landed in its region, and an identity server that reports how many of
its answers went out in place. In a plain importable module, so a `spawn` child unpickles them
without importing a test module."""

from __future__ import annotations

import moecomm
import moecomm.wire.nixl
from moecomm.errors import PeerLostError
from moecomm.testing import check_pattern
from moecomm.wire.server import ServerChannel
from moecomm.wire.transport import WaitOp
from moecomm.wire.views import region_bytes_view

# The receiver's region: its signal word's cache line, then the payload.
LINE = 64
S = 1_000_000_000
WAIT_NS = 30 * S  # generous: a wait here only ends early on success; the cores are shared


def payload_reporter(conn, nbytes):
    """A region of LINE + nbytes; told a value, waits until its word holds it and sends back
    the payload bytes as they are then. "stop" ends it."""
    t = moecomm.wire.nixl.open_nixl_transport()
    r = t.create_region(LINE + nbytes)
    conn.send(r.handle)
    view = region_bytes_view(r)
    while (value := conn.recv()) != "stop":
        t.wait(r, 0, WaitOp.EQUAL, value, timeout_ns=WAIT_NS)
        conn.send(bytes(view[LINE : LINE + nbytes].numpy()))
    conn.send("bye")


def counting_identity_server(conn, layout_dict, client_id, borrow):
    """Answers each request with its own activations, from the request slot they landed in;
    at "stop" reports what it served, its WRITEs and its puts sent in place."""
    layout = moecomm.SlotLayout.from_dict(layout_dict)
    t = moecomm.wire.nixl.open_nixl_transport(borrow=borrow)
    channel = ServerChannel(t, layout, client_id, 1)
    conn.send(channel.handle)
    channel.connect(conn.recv())
    served = rejected = 0
    while True:
        try:
            reqs = channel.wait(timeout=0.05)
        except PeerLostError:
            break
        for req in reqs:
            problem = "invalid" if not req.valid else check_pattern(req, client_id)
            if problem is not None:
                channel.reject(req, moecomm.wire.protocol.ResponseStatus.SERVER_ERROR, problem)
                rejected += 1
                continue
            channel.respond(req, req.activations)
            served += 1
        if not reqs and conn.poll() and conn.recv() == "stop":
            break
    conn.send(
        {
            "served": served,
            "rejected": rejected,
            "writes": t.engine.transfers_by_op["WRITE"],
            "in_place": t.zero_copy_stats,
        }
    )
