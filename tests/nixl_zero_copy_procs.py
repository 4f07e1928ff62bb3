"""The spawned peer of tests/wire/test_nixl_zero_copy.py with its own NIXL agent: a receiver
that reports what landed in its region (the identity server is nixl_helpers'). In a plain
importable module, so a `spawn` child unpickles it without importing a test module."""

from __future__ import annotations

import moecomm
import moecomm.wire.nixl
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
