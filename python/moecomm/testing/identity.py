"""An identity expert server and self-checking payloads, for the protocol demo, the tests and
the round-trip benchmark.

Payloads carry their own origin so that any byte that lands in the wrong place is caught:
x[t, 0] = client id, x[t, 1] = seq, x[t, 2] = token index (each mod 128: exact in bf16, fp16
and int8), expert_ids[t, k] = (t + k + seq) mod 251, scores[t, k] = (7·seq + t·K + k) mod 2^20,
and for quantized encodings scales[t, j] = t + j.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass

import torch

from moecomm.errors import PeerLostError
from moecomm.runtime.launch import spawn_ready
from moecomm.wire.protocol import ENCODING_DTYPE, ResponseStatus, SlotLayout, scales_per_token
from moecomm.wire.server import ServerChannel
from moecomm.wire.shm import ShmTransport

# Small enough that the ids are exact in any encoding and look like real local expert ids.
PATTERN_EXPERTS = 251
# Integers below 2^7 are exact in bf16, fp16 and int8 alike.
PATTERN_MOD = 128
# Integers below 2^24 are exact in f32; keep scores well inside that.
SCORE_MOD = 1 << 20
# How often an idle identity server looks at its control pipe.
CONTROL_POLL_S = 0.05
STOP = "stop"


def make_pattern(
    client_id: int,
    seq: int,
    num_tokens: int,
    layout: SlotLayout,
    generator: torch.Generator | None = None,
):
    """x [n, H], expert_ids [n, K] int32, scores [n, K] f32 and scales [n, S] f32 (None when
    the encoding is not quantized) whose origin can be read back."""
    n, h, k = num_tokens, layout.hidden, layout.topk
    dtype = ENCODING_DTYPE[layout.encoding]
    # Quantized encodings carry small integers; floats carry a normal sample.
    x = torch.randn(n, h, generator=generator) * (8 if dtype == torch.int8 else 1)
    x = x.to(dtype)
    t = torch.arange(n)
    marks = [client_id % PATTERN_MOD, seq % PATTERN_MOD]
    for col, val in enumerate(marks[: min(h, 2)]):
        x[:, col] = val
    if h > 2:
        x[:, 2] = (t % PATTERN_MOD).to(dtype)
    kk = torch.arange(k)
    ids = ((t[:, None] + kk[None, :] + seq) % PATTERN_EXPERTS).to(torch.int32)
    scores = ((7 * seq + t[:, None] * k + kk[None, :]) % SCORE_MOD).to(torch.float32)
    s = scales_per_token(layout.encoding, h)
    scales = (t[:, None] + torch.arange(s)[None, :]).to(torch.float32) if s else None
    return x, ids, scores, scales


def check_pattern(req, client_id: int) -> str | None:
    """None when the request carries the pattern of (client_id, req.seq); else what differs."""
    n, k = req.num_tokens, req.topk
    t = torch.arange(n)
    kk = torch.arange(k)
    want_ids = ((t[:, None] + kk[None, :] + req.seq) % PATTERN_EXPERTS).to(torch.int32)
    if not torch.equal(req.expert_ids, want_ids):
        return "expert ids do not match the pattern"
    want_scores = ((7 * req.seq + t[:, None] * k + kk[None, :]) % SCORE_MOD).to(torch.float32)
    if not torch.equal(req.scores, want_scores):
        return "scores do not match the pattern"
    if req.scales is not None:
        want = (t[:, None] + torch.arange(req.scales.shape[1])[None, :]).to(torch.float32)
        if not torch.equal(req.scales, want):
            return "scales do not match the pattern"
    x = req.activations
    marks = [client_id % PATTERN_MOD, req.seq % PATTERN_MOD]
    for col, val in enumerate(marks[: min(x.shape[1], 2)]):
        if not bool((x[:, col].to(torch.int64) == val).all()):
            return f"activation column {col} does not carry {val}"
    if x.shape[1] > 2 and not torch.equal(x[:, 2].to(torch.int64), t % PATTERN_MOD):
        return "activation column 2 does not carry the token index"
    return None


def serve_identity(
    conn, layout_dict: dict, client_id: int, num_slots: int, check: bool = True
) -> None:
    """Child-process entry: an identity expert server for one client. Answers each valid
    request with its activations, rejects invalid ones with the reason, and stops on "stop"
    over `conn` or when the client dies."""
    layout = SlotLayout.from_dict(layout_dict)
    transport = ShmTransport()
    channel = ServerChannel(transport, layout, client_id, num_slots)
    conn.send(channel.handle)
    channel.connect(conn.recv())
    served = rejected = 0
    out_dtype = ENCODING_DTYPE[layout.out_encoding]
    try:
        while True:
            try:
                reqs = channel.wait(timeout=CONTROL_POLL_S)
            except PeerLostError:
                channel.mark_offline()
                break
            for req in reqs:
                if not req.valid:
                    channel.reject(req)
                    rejected += 1
                    continue
                problem = check_pattern(req, client_id) if check else None
                if problem is not None:
                    channel.reject(req, ResponseStatus.SERVER_ERROR, problem)
                    rejected += 1
                    continue
                y = req.activations
                channel.respond(req, y if y.dtype == out_dtype else y.to(out_dtype))
                served += 1
            if not reqs and conn.poll() and conn.recv() == STOP:
                break
    finally:
        channel.close()
    conn.send({"served": served, "rejected": rejected})


@dataclass
class IdentityServer:
    """Handle on a spawned identity server process."""

    process: mp.Process
    conn: object
    handle: str

    def connect(self, client_handle: str) -> None:
        self.conn.send(client_handle)

    def stop(self, timeout: float = 10.0) -> dict | None:
        """Asks the server to stop; returns its counters (None if it is already gone)."""
        stats = None
        if self.process.is_alive():
            try:
                self.conn.send(STOP)
                if self.conn.poll(timeout):
                    stats = self.conn.recv()
            except (BrokenPipeError, EOFError, ConnectionResetError):
                stats = None
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        return stats


def spawn_identity_server(
    layout: SlotLayout,
    client_id: int,
    num_slots: int = 2,
    check: bool = True,
    start_timeout: float = 60.0,
) -> IdentityServer:
    """Starts serve_identity in a fresh process and returns once its region exists."""
    args = (layout.to_dict(), client_id, num_slots, check)
    proc, conn, handle = spawn_ready(serve_identity, args, "identity server", start_timeout)
    return IdentityServer(proc, conn, handle)
