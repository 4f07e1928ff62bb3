"""The device debug mode, host side: ``MOECOMM_DEVICE_DEBUG=1``.

With the mode on:

- every device wait (the combine's wait for a response signal and for its payload bytes, the
  server gather's read of each request signal and wait for its payload, the transports' probes)
  appends a record to a ring in device memory (:class:`WaitTraceBuffer`, the layout of
  ``csrc/transport/device/wait_trace.h``): the word (offset in our region), the predicate
  (op, mask, value), the last word seen, the peer, the start and elapsed time, the verdict and
  the call site. Off, the kernels get a null ring and pay one predictable branch per wait;
- the native launchers synchronize and check for errors after every kernel (a fault is raised
  naming the kernel that caused it), and the Python launch sites do the same after their own
  device work (the server's Triton expert MLP);
- on a failure — a combine status other than OK, a ``DeviceStepFailedError``, a CUDA error — the
  client or server prints (stderr) its recorded waits, newest first and grouped per awaited
  word, with its own state: the client's per-server status of every slot, the server's entry
  states. A first hang then names the word that never changed.

:func:`decode` reads a ring copied back to the host; its layout is kept here as a ``struct``
format and checked against the one the binding exports (``moecomm._cuda.WAIT_TRACE``) by
tests/runtime/test_device_debug.py, so this module works without a build too.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = [
    "DEBUG_ENV",
    "WaitRecord",
    "WaitTraceBuffer",
    "attach",
    "decode",
    "decode_entries",
    "enabled",
    "format_entries",
    "format_trace",
    "report",
]

DEBUG_ENV = "MOECOMM_DEVICE_DEBUG"

# The layout of wait_trace.h. WaitTraceHeader: next (u64) and 7 reserved words.
HEADER_FORMAT = "<Q56x"
HEADER_BYTES = struct.calcsize(HEADER_FORMAT)
# WaitRecord: 7 u64 then 6 u32, no padding.
RECORD_FORMAT = "<7Q6I"
RECORD_FIELDS = (
    "index",
    "offset",
    "mask",
    "value",
    "observed",
    "start_ns",
    "elapsed_ns",
    "op",
    "status",
    "peer",
    "site",
    "block",
    "thread",
)
RECORD_BYTES = struct.calcsize(RECORD_FORMAT)
# kWaitTraceRecords.
NUM_RECORDS = 512
TRACE_BYTES = HEADER_BYTES + NUM_RECORDS * RECORD_BYTES

# WaitSite numbering.
WAIT_SITES = {
    0: "unknown",
    1: "probe",
    2: "combine signal",
    3: "combine arrival",
    4: "gather signal",
    5: "gather arrival",
}
# transport::WaitOp, and kWaitOpAtLeast (wait_at_least: the counter must reach `value`).
OP_AT_LEAST = 2
_OPS = {0: "==", 1: "!=", OP_AT_LEAST: ">="}
# DeviceWait.
_STATUS = {0: "ok", 1: "TIMEOUT", 2: "PEER_LOST"}
# Records printed in the chronological part of a report (the per-word summary is complete).
REPORT_LAST = 24
# EntryState (dispatch_index.h): 8 int32 words, the last two the u64 sequence.
ENTRY_WORDS = 8
_ENTRY_ACTIONS = {0: "none", 1: "serve", 2: "reject"}
# Signal word: state in bits 0-7 (protocol/signal.h).
_SIGNAL_STATES = {0: "IDLE", 1: "REQUEST_READY", 2: "RESPONSE_READY", 3: "OFFLINE"}
_STATE_BITS = 8


def enabled() -> bool:
    """Whether ``MOECOMM_DEVICE_DEBUG`` turns the mode on (any value but empty or ``0``: the
    native launchers' rule; they read it once per process)."""
    value = os.environ.get(DEBUG_ENV, "").strip()
    return value not in ("", "0")


@dataclass(frozen=True)
class WaitRecord:
    index: int  # 1-based, in the order the waits ended
    offset: int
    mask: int
    value: int
    observed: int
    start_ns: int
    elapsed_ns: int
    op: int
    status: int
    peer: int
    site: int
    block: int
    thread: int

    @property
    def ok(self) -> bool:
        return self.status == 0

    def describe(self) -> str:
        site = WAIT_SITES.get(self.site, f"site {self.site}")
        status = _STATUS.get(self.status, f"status {self.status}")
        op = _OPS.get(self.op, f"op {self.op}")
        if self.op == OP_AT_LEAST:
            want = f"counter >= {self.value}"
            seen = f"{self.observed}"
        else:
            masked = "" if self.mask == (1 << 64) - 1 else f" & {self.mask:#x}"
            want = f"word{masked} {op} {_word(self.value)}"
            seen = _word(self.observed)
        return (
            f"#{self.index} {site}: peer {self.peer} offset {self.offset:#x}: waited for {want}, "
            f"last saw {seen}, {status} after {self.elapsed_ns / 1e3:.1f} us "
            f"(block {self.block} thread {self.thread})"
        )


def _word(w: int) -> str:
    """A signal word as state|seq when it reads as one, else hex."""
    state = w & ((1 << _STATE_BITS) - 1)
    if w == (1 << 64) - 1 or state not in _SIGNAL_STATES:
        return f"{w:#x}"
    return f"{_SIGNAL_STATES[state]}|{w >> _STATE_BITS} ({w:#x})"


def decode(buf: bytes | bytearray | memoryview) -> tuple[list[WaitRecord], int]:
    """The records of a trace ring copied to the host, oldest first, and how many older ones
    were overwritten (the ring holds the last NUM_RECORDS). Slots never written (index 0) are
    skipped."""
    if len(buf) < TRACE_BYTES:
        raise ValueError(f"a wait trace is {TRACE_BYTES} bytes, got {len(buf)}")
    (started,) = struct.unpack_from(HEADER_FORMAT, buf, 0)
    records = []
    for i in range(NUM_RECORDS):
        fields = struct.unpack_from(RECORD_FORMAT, buf, HEADER_BYTES + i * RECORD_BYTES)
        if fields[0] == 0:
            continue
        records.append(WaitRecord(*fields))
    records.sort(key=lambda r: r.index)
    return records, max(0, started - NUM_RECORDS)


def format_trace(records: list[WaitRecord], lost: int = 0, last: int = REPORT_LAST) -> str:
    """The waits that did not end well first, then the last wait on every (site, peer, word),
    then the newest ``last`` records."""
    if not records:
        return "  (no device wait recorded)"
    lines = []
    failed = [r for r in records if not r.ok]
    if failed:
        lines.append(f"  waits that failed ({len(failed)}), newest first:")
        lines += [f"    {r.describe()}" for r in reversed(failed[-last:])]
    latest: dict[tuple[int, int, int], WaitRecord] = {}
    for r in records:
        latest[(r.site, r.peer, r.offset)] = r
    lines.append(f"  last wait on each word ({len(latest)}):")
    lines += [f"    {r.describe()}" for r in sorted(latest.values(), key=lambda r: -r.index)]
    shown = min(last, len(records))
    lines.append(f"  newest {shown} of {len(records)} records ({lost} older overwritten):")
    lines += [f"    {r.describe()}" for r in reversed(records[-last:])]
    return "\n".join(lines)


class WaitTraceBuffer:
    """One trace ring in device memory, zeroed; :func:`attach` hands it to a launch."""

    def __init__(self, device: torch.device | str):
        self.tensor = torch.zeros(TRACE_BYTES, dtype=torch.uint8, device=device)

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()

    def read(self) -> tuple[list[WaitRecord], int]:
        """Copies the ring back (synchronizes with the current stream) and decodes it."""
        return decode(self.tensor.cpu().numpy().tobytes())

    def reset(self) -> None:
        self.tensor.zero_()


def unreadable(exc: BaseException) -> str:
    """A report section standing for a state that could not be read (a sticky CUDA error makes
    every device read fail)."""
    return f"    unreadable: {type(exc).__name__}: {exc}"


def trace_section(trace: WaitTraceBuffer | None) -> str:
    """The "device waits" section of a failure report: ``trace``'s recorded waits, or why there
    are none; never raises (it runs on failure paths, where the device may be gone)."""
    if trace is None:
        return f"    not recorded ({DEBUG_ENV} is off)"
    try:
        return format_trace(*trace.read())
    except Exception as exc:
        return unreadable(exc)


def attach(peers, trace: WaitTraceBuffer | None):
    """The kernels' peer view (IpcPeers / NvshmemPeers) with ``trace`` as its wait trace."""
    if trace is not None:
        peers.wait_trace = trace.ptr
    return peers


def decode_entries(entries: torch.Tensor) -> list[dict]:
    """EntryState rows ([..., 8] int32, any leading shape flattened) as dicts."""
    rows = entries.reshape(-1, ENTRY_WORDS).tolist()
    out = []
    for w in rows:
        seq = (w[6] & 0xFFFFFFFF) | ((w[7] & 0xFFFFFFFF) << 32)
        out.append(
            {
                "action": _ENTRY_ACTIONS.get(w[0], str(w[0])),
                "code": w[1],
                "num_tokens": w[2],
                "topk": w[3],
                "layer": w[4],
                "seq": seq,
            }
        )
    return out


def format_entries(entries: Iterable[dict], num_slots: int, clients: dict[int, int]) -> str:
    """Server entry states, one line per (client, slot) that is not idle."""
    lines = []
    for i, e in enumerate(entries):
        if e["action"] == "none":
            continue
        client = i // num_slots
        who = f"client {client} (id {clients[client]:#x})" if client in clients else f"entry {i}"
        lines.append(
            f"    {who} slot {i % num_slots}: {e['action']} code {e['code']} layer {e['layer']} "
            f"tokens {e['num_tokens']} topk {e['topk']} seq {e['seq']}"
        )
    return "\n".join(lines) if lines else "    (every entry idle)"


def report(title: str, sections: dict[str, str], file=None) -> str:
    """Prints (stderr by default) and returns one debug report."""
    text = f"moecomm device debug: {title}\n" + "\n".join(
        f"{name}:\n{body}" for name, body in sections.items()
    )
    print(text, file=file or sys.stderr, flush=True)
    return text
