"""The device debug mode's host side and the device deadline scale, on CPU.

- the wait-trace decoder reads a hand-built ring laid out as csrc/transport/device/wait_trace.h,
  and its layout is the one moecomm._cuda exports (when it is built);
- a failed combine prints the client's per-slot statuses and the recorded waits;
- MOECOMM_DEVICE_DEADLINE_SCALE multiplies every device deadline: the combine's, the GPU
  server's payload wait, the DeepEP adapter's.
"""

import os
import struct
import subprocess
import sys
import types

import moecomm.wire.cuda
import pytest
import torch
from moecomm.compat.low_latency import device as _ll_device
from moecomm.runtime import device_client, device_debug, device_server
from moecomm.runtime.device_client import DeviceHandle, DeviceStepFailedError, _Server
from moecomm.runtime.device_debug import (
    HEADER_BYTES,
    NUM_RECORDS,
    RECORD_BYTES,
    RECORD_FIELDS,
    RECORD_FORMAT,
    TRACE_BYTES,
    decode,
)

SIG_RESPONSE_READY = 2


def record(
    index,
    site,
    peer=0,
    offset=0x1040,
    op=1,
    mask=(1 << 64) - 1,
    value=0,
    observed=0,
    status=0,
    elapsed_ns=1_000,
    start_ns=5,
    block=0,
    thread=0,
):
    return struct.pack(
        RECORD_FORMAT,
        index,
        offset,
        mask,
        value,
        observed,
        start_ns,
        elapsed_ns,
        op,
        status,
        peer,
        site,
        block,
        thread,
    )


def ring(records: dict[int, bytes], started: int) -> bytearray:
    buf = bytearray(TRACE_BYTES)
    struct.pack_into("<Q", buf, 0, started)
    for slot, raw in records.items():
        buf[HEADER_BYTES + slot * RECORD_BYTES : HEADER_BYTES + (slot + 1) * RECORD_BYTES] = raw
    return buf


def test_the_decoder_reads_a_hand_built_ring_in_order():
    older = SIG_RESPONSE_READY | (8 << 8)  # the answer before ours: it never changed
    buf = ring(
        {
            3: record(4, site=2, peer=1, op=1, value=older, observed=older, status=1),
            0: record(1, site=4, peer=0, op=1, value=(1 << 64) - 1, observed=1 | (3 << 8)),
            1: record(2, site=5, peer=0, op=2, value=4096, observed=2048, status=1),
            2: record(0, site=4),  # being rewritten when copied: skipped
        },
        started=4,
    )
    records, lost = decode(buf)
    assert [r.index for r in records] == [1, 2, 4] and lost == 0
    timed_out = records[-1]
    assert (timed_out.site, timed_out.peer, timed_out.status) == (2, 1, 1)
    text = device_debug.format_trace(records, lost)
    assert "waits that failed (2)" in text
    assert "combine signal: peer 1" in text and "TIMEOUT" in text
    assert "last saw RESPONSE_READY|8" in text
    assert "gather arrival: peer 0" in text and "counter >= 4096, last saw 2048" in text
    assert "REQUEST_READY|3" in text


def test_a_ring_that_wrapped_reports_the_overwritten_records():
    started = NUM_RECORDS + 10
    buf = ring(
        {i: record(i + NUM_RECORDS + 1 if i < 10 else i + 1, site=4) for i in range(NUM_RECORDS)},
        started,
    )
    records, lost = decode(buf)
    assert lost == 10 and len(records) == NUM_RECORDS
    assert records[0].index == 11 and records[-1].index == started
    with pytest.raises(ValueError, match="wait trace"):
        decode(buf[:-1])


def test_the_python_layout_is_the_bindings():
    if not moecomm.wire.cuda.built("_cuda"):
        pytest.skip("moecomm._cuda not built (no nvcc)")
    lay = moecomm.wire.cuda.cuda_module(need_device=False).WAIT_TRACE
    assert lay["record_bytes"] == RECORD_BYTES == 80
    assert lay["header_bytes"] == HEADER_BYTES and lay["next_offset"] == 0
    assert lay["records"] == NUM_RECORDS and lay["bytes"] == TRACE_BYTES
    offsets, at = {}, 0
    for name, code in zip(
        RECORD_FIELDS, RECORD_FORMAT[1:].replace("7Q", "Q" * 7).replace("6I", "I" * 6), strict=True
    ):
        offsets[name] = at
        at += struct.calcsize("<" + code)
    assert lay["fields"] == offsets
    names = {v: k.lower().replace("_", " ") for k, v in lay["sites"].items()}
    assert names == device_debug.WAIT_SITES
    assert lay["op_at_least"] == device_debug.OP_AT_LEAST


def test_the_mode_is_read_from_the_environment(monkeypatch):
    for value, on in (("", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(device_debug.DEBUG_ENV, value)
        assert device_debug.enabled() is on
    if not moecomm.wire.cuda.built("_cuda"):
        return
    code = "import moecomm.wire.cuda as c; print(c.cuda_module(need_device=False).device_debug())"
    for value, on in (("1", "True"), ("0", "False")):
        env = dict(os.environ, MOECOMM_DEVICE_DEBUG=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == on


def test_entry_states_decode():
    e = torch.zeros(2, 8, dtype=torch.int32)
    e[1] = torch.tensor([2, 11, 3, 2, 5, 0, 7, 1], dtype=torch.int32)
    rows = device_debug.decode_entries(e)
    assert rows[1] == {
        "action": "reject",
        "code": 11,
        "num_tokens": 3,
        "topk": 2,
        "layer": 5,
        "seq": 7 | (1 << 32),
    }
    text = device_debug.format_entries(rows, num_slots=2, clients={0: 0xAB})
    assert "client 0 (id 0xab) slot 1: reject code 11 layer 5" in text


# ------------------------------------------------------------------ the client's failure report
class _Args:
    pass


class _Workspace:
    """The client workspace fields the combine and the report read, laid out in one tensor."""

    NAMES = ("status", "detail", "sent_seq", "pending_seq", "arrival_sent", "count")

    def __init__(self, n):
        self.layout = {}
        at = 0
        for name in self.NAMES:
            self.layout[name] = at
            at += 8 * n
        self.total = at


def stand_in_client(monkeypatch, statuses: list[int], trace_bytes: bytes | None):
    """A DeviceClient with a stand-in native module whose combine reports `statuses`."""
    n = len(statuses)
    ws = _Workspace(n)
    codes = {"OK": 0, "TIMEOUT": 1, "PEER_LOST": 2, "NOT_SENT": 3, "SLOT_BUSY": 9}
    launches = []

    def combine(peers, cfg, a, stream):
        launches.append(a)
        c.status(a.slot)[0].copy_(torch.tensor(statuses, dtype=torch.int32))

    k = types.SimpleNamespace(
        DispatchArgs=_Args,
        CombineArgs=_Args,
        SERVER_STATUS=codes,
        client_dispatch=lambda *a: None,
        client_combine=combine,
    )
    monkeypatch.setattr(device_client, "_stream", lambda device: 0)
    monkeypatch.setattr("moecomm.runtime.control.http_disconnect", lambda *a, **kw: None)
    c = device_client.DeviceClient.__new__(device_client.DeviceClient)
    c._k, c.device, c.client_id, c.token, c.timeout = k, torch.device("cpu"), 0x5A, "", 0.25
    c.table = types.SimpleNamespace(
        kernel_peers=lambda: types.SimpleNamespace(),
        mark_dead=lambda i: None,
        remove_peer=lambda i, s: None,
    )
    c.layout = types.SimpleNamespace(hidden=8, max_tokens=4, out_encoding=None)
    c.config = types.SimpleNamespace(num_servers=n)
    c.workspace_layout = ws.layout
    c.workspaces = [torch.zeros(ws.total, dtype=torch.uint8)]
    c.next_seq = torch.zeros(n, dtype=torch.int64)
    c.servers = {i: _Server(f"http://s{i}", f"s{i}", "", {0: [i]}) for i in range(n)}
    c._rings = {i: i for i in range(n)}
    c._maps = device_client.ExpertMaps("cpu", 8)
    c._rebuild_maps()
    c._trace = None
    if trace_bytes is not None:
        c._trace = device_debug.WaitTraceBuffer("cpu")
        c._trace.tensor.copy_(torch.frombuffer(bytearray(trace_bytes), dtype=torch.uint8))
    return c, launches


def test_a_failed_combine_prints_the_statuses_and_the_waits(monkeypatch, capsys):
    older = SIG_RESPONSE_READY | (2 << 8)
    trace = ring(
        {
            0: record(
                1, site=2, peer=1, value=older, observed=older, status=1, elapsed_ns=250_000_000
            )
        },
        started=1,
    )
    c, _ = stand_in_client(monkeypatch, [0, 1], bytes(trace))
    h = DeviceHandle(0, 0, torch.zeros(2, 8), torch.tensor([[0, 1], [1, 0]]), torch.ones(2, 2))
    with pytest.raises(DeviceStepFailedError, match=r"experts \[1\] have no live server"):
        c.combine(h, out=torch.zeros(2, 8))
    err = capsys.readouterr().err
    assert "moecomm device debug: client 0x5a: layer 0: combine attempt 0 failed" in err
    assert "slot 0 server 1: TIMEOUT" in err and "http://s1" in err
    assert "combine signal: peer 1" in err and "last saw RESPONSE_READY|2" in err
    assert "DeviceStepFailedError" in err


def test_without_the_mode_a_failed_combine_prints_nothing(monkeypatch, capsys):
    c, _ = stand_in_client(monkeypatch, [0, 1], None)
    h = DeviceHandle(0, 0, torch.zeros(2, 8), torch.tensor([[0, 1], [1, 0]]), torch.ones(2, 2))
    with pytest.raises(DeviceStepFailedError):
        c.combine(h, out=torch.zeros(2, 8))
    assert "device debug" not in capsys.readouterr().err


# ------------------------------------------------------------------ the deadline scale
def test_every_device_deadline_follows_the_scale(monkeypatch):
    monkeypatch.delenv(moecomm.wire.cuda.DEADLINE_SCALE_ENV, raising=False)
    base = (
        device_client.combine_timeout_ns(0.25),
        moecomm.wire.cuda.arrival_timeout_ns(),
        _ll_device.arrival_timeout_ns(),
    )
    # One fact: the GPU server's and the adapter's gathers wait the same 20 us.
    assert base == (
        250_000_000,
        moecomm.wire.cuda.ARRIVAL_TIMEOUT_NS,
        moecomm.wire.cuda.ARRIVAL_TIMEOUT_NS,
    )
    monkeypatch.setenv(moecomm.wire.cuda.DEADLINE_SCALE_ENV, "40")
    assert device_client.combine_timeout_ns(0.25) == 40 * base[0]
    assert moecomm.wire.cuda.arrival_timeout_ns() == 40 * base[1]
    assert _ll_device.arrival_timeout_ns() == 40 * base[2]
    # Reached from the launch sites: the client's combine and the server's gather arguments.
    c, launches = stand_in_client(monkeypatch, [0, 0], None)
    c.wait(2, 0, 0, torch.zeros(2, 8))
    assert launches[-1].timeout_ns == 40 * 250_000_000
    srv = device_server.DeviceExpertServer.__new__(device_server.DeviceExpertServer)
    srv._k = types.SimpleNamespace(ServerGatherArgs=_Args)
    srv.layer_hosted, srv.workspace, srv.draining = torch.ones(2), torch.zeros(64), False
    assert srv._gather_args(1).arrival_timeout_ns == 40 * base[1]
    for bad in ("0", "-1", "x", "inf"):
        monkeypatch.setenv(moecomm.wire.cuda.DEADLINE_SCALE_ENV, bad)
        with pytest.raises(ValueError, match="MOECOMM_DEVICE_DEADLINE_SCALE"):
            device_client.combine_timeout_ns(1.0)
