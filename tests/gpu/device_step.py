"""One device client step (dispatch -> server gather -> expert -> respond -> combine) driven
through the bindings with no torch: every device buffer is carved out of a transport region
(an IpcRegion or an NvshmemRegion), filled and read back with the region's own copies. Shared
by the CUDA-IPC and NVSHMEM GPU tests; the expected results are plain numpy.

The stand-in expert is the identity: the server answers every row with score * activation, so
the client's combine must give y[t] = sum over k of w[t, k] * x[t] (f32, k order), exactly for
the small integers and powers of two used here.
"""

from __future__ import annotations

import numpy as np

HIDDEN = 64
TOPK = 2
MAX_TOKENS = 8
NUM_TOKENS = 5
NUM_SLOTS = 2
NUM_EXPERTS = 4
CLIENT_ID = 7
LAYER = 3
BLOCK_M = 16  # the grouped GEMM's M tile the gather shrinks to; any value >= 1 works here
ALIGN = 256  # sub-buffers start at this alignment (workspaces need 64 B)
ENTRY_BYTES = 32  # sizeof(EntryState): action int32 first
SERVE = 1  # EntryAction::kServe


def slot_config():
    from moecomm import _C

    return _C.SlotConfig(MAX_TOKENS, HIDDEN, TOPK, _C.Encoding.F32, _C.Encoding.F32)


def ring_bytes() -> tuple[int, int]:
    """(request ring, response ring) sizes for one (client, server) pair."""
    from moecomm import _C

    cfg = slot_config()
    return _C.SlotRing(cfg, NUM_SLOTS, True).region_bytes, _C.SlotRing(
        cfg, NUM_SLOTS, False
    ).region_bytes


def inputs(num_servers: int = 1):
    """x [T, H] f32, ids [T, K] int32, w [T, K] f32, and the expert map: expert e on server
    e * num_servers // NUM_EXPERTS, local index e % (NUM_EXPERTS // num_servers)."""
    x = (np.arange(NUM_TOKENS * HIDDEN, dtype=np.float32) % 13 + 1).reshape(NUM_TOKENS, HIDDEN)
    t = np.arange(NUM_TOKENS, dtype=np.int32)[:, None]
    ids = np.concatenate([t % NUM_EXPERTS, (t + 1) % NUM_EXPERTS], axis=1).astype(np.int32)
    w = np.tile(np.array([0.5, 0.25], dtype=np.float32), (NUM_TOKENS, 1))
    per = NUM_EXPERTS // num_servers
    e = np.arange(NUM_EXPERTS)
    return x, ids, w, (e // per).astype(np.int32), (e % per).astype(np.int32)


def expected_y(x, w):
    y = np.zeros_like(x)
    for k in range(TOPK):
        y = y + w[:, k : k + 1] * x
    return y


class Arena:
    """Sub-buffers of one device region: `write(offset, bytes)`, `read(offset, n)`, base `ptr`."""

    def __init__(self, ptr: int, size: int, write, read):
        self.ptr, self.size, self._write, self._read, self._at = ptr, size, write, read, 0

    def alloc(self, nbytes: int) -> int:
        off = self._at
        self._at = -(-(off + max(nbytes, 1)) // ALIGN) * ALIGN
        assert self._at <= self.size, "arena too small"
        return off

    def put(self, array: np.ndarray) -> int:
        off = self.alloc(array.nbytes)
        self._write(off, np.ascontiguousarray(array).tobytes())
        return off

    def write(self, off: int, data: bytes) -> None:
        self._write(off, data)

    def read(self, off: int, n: int) -> bytes:
        return self._read(off, n)

    def addr(self, off: int) -> int:
        return self.ptr + off


def client_config(k, arena: Arena, num_servers: int, request_offsets, response_offsets):
    cfg = k.ClientConfig()
    cfg.num_servers, cfg.num_slots, cfg.client_id = num_servers, NUM_SLOTS, CLIENT_ID
    s = slot_config()
    cfg.max_tokens, cfg.hidden, cfg.topk = s.max_tokens, s.hidden, s.topk
    cfg.encoding = cfg.out_encoding = int(s.encoding)
    cfg.request_ring_offset = arena.addr(arena.put(np.asarray(request_offsets, np.uint64)))
    cfg.response_ring_offset = arena.addr(arena.put(np.asarray(response_offsets, np.uint64)))
    return cfg


def dispatch_args(k, arena: Arena, num_servers: int, workspace: int, slot: int = 0):
    """DispatchArgs for inputs(num_servers), their device copies carved from `arena`."""
    x, ids, w, srv, loc = inputs(num_servers)
    a = k.DispatchArgs()
    a.x, a.x_dtype, a.x_row_stride = arena.addr(arena.put(x)), int(slot_config().encoding), HIDDEN
    a.topk_ids, a.ids_int64 = arena.addr(arena.put(ids)), False
    a.topk_weights, a.weights_dtype = arena.addr(arena.put(w)), int(slot_config().encoding)
    a.num_tokens, a.topk = NUM_TOKENS, TOPK
    a.expert_server, a.expert_local = arena.addr(arena.put(srv)), arena.addr(arena.put(loc))
    a.num_experts, a.layer_id, a.slot = NUM_EXPERTS, LAYER, slot
    a.next_seq = arena.addr(arena.put(np.zeros(num_servers, np.uint64)))
    a.workspace = workspace
    return a


def combine_args(k, workspace: int, out: int, timeout_ns: int, slot: int = 0):
    a = k.CombineArgs()
    a.num_tokens, a.layer_id, a.slot, a.timeout_ns = NUM_TOKENS, LAYER, slot, timeout_ns
    a.workspace, a.out, a.out_dtype = workspace, out, int(slot_config().out_encoding)
    return a


def server_config(k, arena: Arena, request_offset: int, response_offset: int):
    cfg = k.ServerConfig()
    cfg.num_clients, cfg.num_slots = 1, NUM_SLOTS
    cfg.num_experts, cfg.max_step_tokens = NUM_EXPERTS, MAX_TOKENS
    s = slot_config()
    cfg.max_tokens, cfg.hidden, cfg.topk = s.max_tokens, s.hidden, s.topk
    cfg.encoding = cfg.out_encoding = int(s.encoding)
    cfg.client_ids = arena.addr(arena.put(np.array([CLIENT_ID], np.uint64)))
    cfg.request_ring_offset = arena.addr(arena.put(np.array([request_offset], np.uint64)))
    cfg.response_ring_offset = arena.addr(arena.put(np.array([response_offset], np.uint64)))
    return cfg


def identity_expert(layout: dict, read) -> np.ndarray:
    """expert_out [max_rows, H] f32 = row_scores[i] * rows[i], from the server workspace (read =
    read(offset, nbytes) of the workspace, after the gather has run)."""
    n = layout["max_rows"]
    rows = np.frombuffer(read(layout["rows"], n * HIDDEN * 4), np.float32).reshape(n, HIDDEN)
    scores = np.frombuffer(read(layout["row_scores"], n * 4), np.float32)
    with np.errstate(all="ignore"):  # unfilled rows hold anything; no token points at them
        out = scores[:, None] * rows
    return np.ascontiguousarray(out, dtype=np.float32)


def entry_action(layout: dict, read, entry: int = 0) -> int:
    raw = read(layout["entries"] + entry * ENTRY_BYTES, 4)
    return int(np.frombuffer(raw, np.int32)[0])


def gathered_x(layout: dict, read) -> np.ndarray:
    raw = read(layout["x"], NUM_TOKENS * HIDDEN * 4)
    return np.frombuffer(raw, np.float32).reshape(NUM_TOKENS, HIDDEN)


def statuses(layout: dict, read, num_servers: int) -> list[int]:
    return [int(v) for v in np.frombuffer(read(layout["status"], 4 * num_servers), np.int32)]
