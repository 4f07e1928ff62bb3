"""Rank processes for test_nixl_ep.py: moecomm.compat.nixl_ep.Buffer between spawned processes,
driven with the calls vLLM's NixlEPAll2AllManager / NixlEPPrepareAndFinalize make, checked
against a plain-torch reference of NIXL-EP's low-latency semantics (with moecomm's deterministic
order). Every rank regenerates every rank's inputs from the seed.

Reference: local expert ``i`` of rank ``r`` (expert ``e = r*L + i``) receives, from every rank
``p`` that sent to it this round (the live ones), the tokens ``t`` whose ``topk_idx[p][t]`` holds
``e``: source rank major, token ascending; ``layout_range[i, p] = begin << 32 | count``; fp8 rows
are DeepEP's cast (NIXL-EP's kernels are DeepEP's). The "experts" scale their rows per expert
(``y = bf16(f32(x) * (1 + e/8))``). Combine: ``out[t] = Σ_k w[t, k] · y(t, k)`` in f32, k
ascending, over the k whose expert is ``>= 0`` and whose rank is still live at the combine
(NIXL-EP drops the rest), cast to bf16 — compared bit for bit.

Each rank sends ``(phase, "ok" | traceback, seconds)`` over its pipe after every phase and
``("end", ...)`` last, so the parent sees how far each rank got even when one hangs or dies.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
import traceback

import torch

M, HIDDEN, L, TOPK = 8, 256, 4, 3
TIMEOUT_MS = 20_000
SYNC_TIMEOUT_S = 60.0
# The "elastic" group: capacity 4, ranks 0..2 from the start, rank 3 joins, leaves; 2 is killed.
ELASTIC_RANKS, ELASTIC_CAPACITY, VICTIM = 4, 4, 2
# The "replicas" group: 3 ranks, rank 1 killed. Its experts 4..7: 4 and 5 have live replicas
# (5: first choice rank 2, then 0), 6's only replica is on rank 0, 7 has none (dropped).
REPLICAS = {4: [2], 5: [2, 0], 6: [0], 9: [1]}
REPLICA_RANKS, REPLICA_VICTIM = 3, 1


# ---------------------------------------------------------------------------- reference
def make_inputs(seed: int, rank: int, num_tokens: int, num_experts: int):
    """x [T, H] bf16, topk_idx [T, K] int64 (distinct experts < num_experts, one -1), w f32."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = (torch.randn(num_tokens, HIDDEN, generator=g) * (1 + rank)).to(torch.bfloat16)
    rows = [torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(num_tokens)]
    idx = torch.stack(rows).to(torch.int64) if rows else torch.empty(0, TOPK, dtype=torch.int64)
    if num_tokens > 1:
        idx[1, 2] = -1
    w = torch.rand(num_tokens, TOPK, generator=g)
    return x, idx, w


def fp8_cast(x: torch.Tensor):
    """DeepEP's (NIXL-EP's) low-latency fp8 cast, written apart from the adapter: per 128
    channels amax = max(|x|, 1e-4), scale 448/amax, scale_inv amax * f32(1/448), e4m3 of x *
    scale, saturated. Returns (q [n, H], scale_inv [n, H/128], dequantized f32 [n, H])."""
    n, h = x.shape
    v = x.float().reshape(n, h // 128, 128)
    amax = v.abs().amax(dim=2).clamp(min=1e-4)
    inv = amax * torch.tensor(1 / 448, dtype=torch.float32)
    q = (v * (torch.tensor(448.0) / amax)[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.reshape(n, h), inv, (q.float() * inv[:, :, None]).reshape(n, h)


def expert(rows_f32: torch.Tensor, e: int) -> torch.Tensor:
    return (rows_f32 * (1.0 + e / 8.0)).to(torch.bfloat16)


def dequant(recv_x, i: int, n: int, use_fp8: bool) -> torch.Tensor:
    if not use_fp8:
        return recv_x[i, :n].float()
    data, scales = recv_x
    s = scales[i, :n].repeat_interleave(128, dim=1)
    return data[i, :n].float() * s


def check_dispatch(buf, inputs: dict, senders, rb: int, recv_x, count, handle, use_fp8, experts):
    """What this rank received, against the reference; returns the experts' outputs (NaN past
    the counts). `inputs` {rank: (x, idx, w)}, `senders` the ranks whose copies arrived,
    `experts` the logical expert of each row block (buf.local_experts)."""
    r = buf.rank
    nl = len(experts)
    rows = rb * M
    data = recv_x[0] if use_fp8 else recv_x
    assert tuple(data.shape) == (nl, rows, HIDDEN), (tuple(data.shape), (nl, rows, HIDDEN))
    assert data.is_contiguous()
    if use_fp8:
        assert tuple(recv_x[1].shape) == (nl, rows, HIDDEN // 128)
        assert recv_x[1].stride(1) == 1, "scales are column-major in the last two dims"
    src_info, layout_range = handle[0], handle[1]
    assert tuple(handle[2:]) == (M, HIDDEN) and len(handle) == 4
    assert tuple(src_info.shape) == (nl, rows) and tuple(layout_range.shape) == (nl, rb)
    y = torch.full((nl, rows, HIDDEN), float("nan"), dtype=torch.bfloat16)
    casts = {p: fp8_cast(inputs[p][0]) for p in senders} if use_fp8 else {}
    for i, e in enumerate(experts):
        want = [(p, t) for p in sorted(senders) for t in range(inputs[p][1].shape[0])]
        want = [(p, t) for p, t in want if e in inputs[p][1][t].tolist() and routes(e, buf) == r]
        n = len(want)
        assert int(count[i]) == n, f"rank {r} expert {e}: count {int(count[i])}, expected {n}"
        assert src_info[i, :n].tolist() == [t for _, t in want], f"src_info of expert {e}"
        begin = 0
        for p in range(rb):
            c = sum(1 for q, _ in want if q == p)
            assert int(layout_range[i, p]) == (begin << 32) | c, f"layout_range[{e}, {p}]"
            begin += c
        if not n:
            continue
        if use_fp8:
            q = torch.stack([casts[p][0][t] for p, t in want])
            s = torch.stack([casts[p][1][t] for p, t in want])
            assert torch.equal(recv_x[0][i, :n].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(recv_x[1][i, :n], s)
        else:
            rows_ = torch.stack([inputs[p][0][t] for p, t in want])
            assert torch.equal(recv_x[i, :n].view(torch.int16), rows_.view(torch.int16))
        y[i, :n] = expert(dequant(recv_x, i, n, use_fp8), e)
    return y


def routes(e: int, buf) -> int:
    """The rank copies of expert e go to from this rank (its mask at the dispatch), as the
    replicas routing decides; the primary without replicas."""
    return buf._route_for_test[e]


def reference_combine(x, idx, w, use_fp8: bool, keep) -> torch.Tensor:
    deq = fp8_cast(x)[2] if use_fp8 else x.float()
    ref = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0 and keep(e):
                ref[t] = ref[t] + w[t, k] * expert(deq[t], e).float()
    return ref.to(torch.bfloat16)


def set_routes(buf, masked: set, capacity: int, replicas: dict | None) -> None:
    """Where each expert's copies go under `masked` (the rank's mask at the next dispatch)."""
    out = {}
    for e in range(capacity * L):
        out[e] = e // L
        for q in [e // L, *(replicas or {}).get(e, [])]:
            if q not in masked:
                out[e] = q
                break
    buf._route_for_test = out


def mask_of(buf, capacity: int) -> list[int]:
    status = torch.zeros(capacity, dtype=torch.int32)
    buf.query_mask_buffer(status)
    return status.tolist()


def round_trip(
    buf,
    seed: int,
    ranks: list[int],
    capacity: int,
    *,
    num_experts=None,
    expert_range: int | None = None,
    use_fp8: bool = False,
    hook: bool = False,
    zero_copy: bool = False,
    senders=None,
    answered=None,
    replicas=None,
    experts=None,
    stats: bool = False,
):
    """One dispatch + combine with vLLM's call forms, checked. `ranks`: the live ranks (this
    one's view); `senders` (default `ranks`): whose copies arrive; `answered` (default `ranks`):
    the ranks whose answers count at the combine. Returns the combine output."""
    r = buf.rank
    senders = ranks if senders is None else senders
    answered = ranks if answered is None else answered
    rng = expert_range or (num_experts or (max(ranks) + 1) * L)
    inputs = {p: make_inputs(seed, p, M - (p % 3), rng) for p in set(senders) | {r}}
    x, idx, w = inputs[r]
    rb = (num_experts or (max(ranks) + 1) * L) // L
    set_routes(buf, set(range(capacity)) - set(ranks), capacity, replicas)
    experts = buf.local_experts if experts is None else experts
    cum = torch.zeros(len(experts), dtype=torch.int32) if stats else None
    cost = torch.zeros(rb, dtype=torch.int64) if stats else None
    # NixlEPPrepareAndFinalize.prepare_async's call, written out as vLLM makes it.
    recv_x, count, handle, event, recv_hook = buf.dispatch(
        x,
        idx,
        M,
        num_experts,
        cumulative_local_expert_recv_stats=cum,
        dispatch_wait_recv_cost_stats=cost,
        use_fp8=use_fp8,
        round_scale=False,
        use_ue8m0=False,
        async_finish=False,
        return_recv_hook=hook,
    )
    assert (recv_hook is not None) == hook and event.event is None
    if hook:
        recv_hook()
        recv_hook()  # a second call is a no-op
    y = check_dispatch(buf, inputs, senders, rb, recv_x, count, handle, use_fp8, experts)
    if stats:
        assert torch.equal(cum, count), (cum, count)
        assert all(int(cost[p]) == 0 for p in range(rb) if p not in senders), cost
        assert bool((cost >= 0).all()) and int(cost.sum()) > 0
    if zero_copy:
        buf.get_next_combine_buffer(handle)[:, :, :] = y
    output = torch.empty(x.shape[0], HIDDEN, dtype=torch.bfloat16)
    # NixlEPPrepareAndFinalize._finalize's call.
    _, _, combine_hook = buf.combine(
        y,
        idx,
        w,
        handle,
        async_finish=False,
        zero_copy=zero_copy,
        return_recv_hook=hook,
        out=output,
    )
    if hook:
        combine_hook()
    live = set(answered)
    ref = reference_combine(x, idx, w, use_fp8, lambda e: routes(e, buf) in live)
    assert torch.equal(output.view(torch.int16), ref.view(torch.int16)), "combine != reference"
    return output


def two_in_flight(buf, seeds: tuple, ranks: list[int], capacity: int, use_fp8: bool) -> None:
    """vLLM's dual-batch overlap: two dispatches sent, received in reverse order, two combines
    sent, reduced in reverse order (num_experts=None: the active bound), all checked."""
    r = buf.rank
    rb = max(ranks) + 1
    set_routes(buf, set(range(capacity)) - set(ranks), capacity, None)
    runs = []
    for seed in seeds:
        inputs = {p: make_inputs(seed, p, M - (p % 3), rb * L) for p in ranks}
        x, idx, _ = inputs[r]
        runs.append(
            (inputs, *buf.dispatch(x, idx, M, None, use_fp8=use_fp8, return_recv_hook=True))
        )
    for run in reversed(runs):
        run[5]()
    pending = []
    for inputs, recv_x, count, handle, _, _ in runs:
        y = check_dispatch(
            buf, inputs, ranks, rb, recv_x, count, handle, use_fp8, buf.local_experts
        )
        x, idx, w = inputs[r]
        out = torch.empty(x.shape[0], HIDDEN, dtype=torch.bfloat16)
        _, _, h = buf.combine(y, idx, w, handle, return_recv_hook=True, out=out)
        pending.append((inputs[r], out, h))
    for (x, idx, w), out, h in reversed(pending):
        h()
        ref = reference_combine(x, idx, w, use_fp8, lambda e: e // L in ranks)
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


# ---------------------------------------------------------------------------- plumbing
def sync(store, name: str, count: int) -> None:
    """A barrier of `count` processes through the store, with a deadline."""
    store.add(f"sync/{name}", 1)
    deadline = time.monotonic() + SYNC_TIMEOUT_S
    while int(store.add(f"sync/{name}", 0)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"sync {name}: not every rank arrived in {SYNC_TIMEOUT_S} s")
        time.sleep(0.01)


def open_store(spec: tuple):
    import torch.distributed as dist

    kind, arg, world = spec
    timeout = datetime.timedelta(seconds=SYNC_TIMEOUT_S)
    if kind == "tcp":
        return dist.TCPStore("127.0.0.1", arg, None, False, timeout=timeout)
    return dist.FileStore(arg, world)


class Phases:
    def __init__(self, conn) -> None:
        self.conn, self.failed = conn, False

    def run(self, name: str, fn) -> None:
        if self.failed:
            return
        t0 = time.monotonic()
        try:
            fn()
            self.conn.send((name, "ok", time.monotonic() - t0))
        except BaseException:
            self.failed = True
            self.conn.send((name, traceback.format_exc(), time.monotonic() - t0))

    def end(self) -> None:
        self.conn.send(("end", "ok", 0.0))


def new_buffer(rank: int, store, capacity: int, **kw):
    from moecomm.compat.nixl_ep import Buffer

    # NixlEPAll2AllManager._init_buffer's calls, as vLLM makes them.
    num_rdma_bytes = Buffer.get_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=M,
        hidden=HIDDEN,
        num_ranks=capacity,
        num_experts=capacity * L,
    )
    buffer = Buffer(
        rank=rank,
        tcp_store_group=store,
        timeout_ms=TIMEOUT_MS,
        connect_timeout=SYNC_TIMEOUT_S,
        **kw,
    )
    buffer.update_memory_buffers(
        num_ranks=capacity, num_experts_per_rank=L, num_rdma_bytes=num_rdma_bytes
    )
    return buffer


# ---------------------------------------------------------------------------- elastic group
def elastic_rank(rank: int, store_spec: tuple, conn) -> None:
    """Ranks 0..2 serve from the start; rank 3 connects later, warms up alone behind masks and is
    unmasked; then it leaves; then rank 2 is killed mid-round."""
    torch.set_num_threads(1)
    store = open_store(store_spec)
    ph = Phases(conn)
    cap = ELASTIC_CAPACITY
    old = [0, 1, 2]
    everyone = [0, 1, 2, 3]
    st: dict = {}

    def connect():
        st["buf"] = buf = new_buffer(rank, store, cap)
        if rank in old:
            buf.connect_ranks(list(range(3)))  # _init_buffer: ranks_to_connect = range(world)
            assert mask_of(buf, cap) == [0, 0, 0, 1]

    def bf16_active_bound():  # num_experts=None: the active ranks' bound (3 of 4)
        round_trip(st["buf"], 1, old, cap)
        two_in_flight(st["buf"], (5, 6), old, cap, use_fp8=True)

    def fp8_capacity():  # vLLM's expert_capacity = L * max_num_ep_ranks: rank 3 masked
        round_trip(st["buf"], 2, old, cap, num_experts=cap * L, use_fp8=True, hook=True)
        round_trip(st["buf"], 3, old, cap, num_experts=cap * L, zero_copy=True, stats=True)

    def barrier():
        st["buf"].barrier()
        round_trip(st["buf"], 4, old, cap, use_fp8=True)

    def solo():
        # vLLM's mask_remote_ranks on every old rank, each alone for a different number of
        # rounds; then all unmask and meet again.
        buf = st["buf"]
        peers = [p for p in old if p != rank]
        for p in peers:
            buf.update_mask_buffer(p, mask=True)
        for i in range(rank + 1):
            round_trip(buf, 10 + i, [rank], cap, num_experts=cap * L, expert_range=3 * L)
        for p in peers:
            buf.update_mask_buffer(p, mask=False)
        round_trip(buf, 20, old, cap, hook=True)

    def join():
        buf = st["buf"]
        if rank in old:
            # _connect_to_ep_size(make_active=False) at stage: the new rank stays masked.
            buf.set_tcp_store_group(store)
            buf.connect_ranks([3], activate=False)
            assert mask_of(buf, cap) == [0, 0, 0, 1]
            for seed in (30, 31):  # serving goes on among the old ranks meanwhile
                round_trip(buf, seed, old, cap, num_experts=cap * L)
            sync(store, "commit", 4)
            # _unmask_connected_ranks at commit.
            buf.set_tcp_store_group(store)
            buf.update_mask_buffer(3, mask=False)
        else:
            buf.connect_ranks(everyone)  # the new rank's _init_buffer
            assert mask_of(buf, cap) == [0, 0, 0, 0]
            # warm_and_capture under mask_remote_ranks: alone, peers masked, then unmasked.
            for p in old:
                buf.update_mask_buffer(p, mask=True)
            for seed in (40, 41, 42):
                round_trip(buf, seed, [3], cap, num_experts=cap * L)
            for p in old:
                buf.update_mask_buffer(p, mask=False)
            sync(store, "commit", 4)
        assert mask_of(buf, cap) == [0, 0, 0, 0]
        round_trip(buf, 50, everyone, cap, num_experts=cap * L, use_fp8=True)
        round_trip(buf, 51, everyone, cap, hook=True, stats=True)

    def leave():
        buf = st["buf"]
        sync(store, "leave", 4)
        if rank == 3:
            buf.disconnect_ranks(old)
            assert mask_of(buf, cap) == [1, 1, 1, 0]
            return
        buf.disconnect_ranks([3])  # _disconnect_to_ep_size at commit
        assert mask_of(buf, cap) == [0, 0, 0, 1]
        round_trip(buf, 60, old, cap, num_experts=cap * L, use_fp8=True)
        round_trip(buf, 61, old, cap)

    def kill():
        buf = st["buf"]
        if rank == 3:
            return
        sync(store, "kill", 3)
        if rank == VICTIM:  # sends its dispatch of this round, then dies before anything else
            x, idx, _ = make_inputs(70, rank, M - (rank % 3), cap * L)
            buf.dispatch(x, idx, M, cap * L, use_fp8=False, return_recv_hook=True)
            conn.send(("kill", "ok", 0.0))
            os.kill(os.getpid(), signal.SIGKILL)
        survivors = [0, 1]
        # Its requests arrived; its answers never come: masked during the combine, its
        # experts' copies dropped.
        round_trip(buf, 70, old, cap, num_experts=cap * L, answered=survivors)
        assert mask_of(buf, cap) == [0, 0, 1, 1]
        assert any("rank 2" in f for f in buf.runtime.engine.failures)
        round_trip(buf, 71, survivors, cap, num_experts=cap * L, use_fp8=True)
        # NixlEPAll2AllManager.clean_buffers (the fault-tolerance retry): the dead rank is
        # still connected, so it is unmasked, and found dead again at the next dispatch.
        buf.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
        buf.clean_mask_buffer()
        assert mask_of(buf, cap) == [0, 0, 0, 1]
        round_trip(buf, 72, old, cap, num_experts=cap * L, senders=survivors, answered=survivors)
        assert mask_of(buf, cap) == [0, 0, 1, 1]
        round_trip(buf, 73, survivors, cap)

    try:
        ph.run("connect", connect)
        if rank in old:
            ph.run("bf16_active_bound", bf16_active_bound)
            ph.run("fp8_capacity", fp8_capacity)
            ph.run("barrier", barrier)
            ph.run("solo", solo)
        ph.run("join", join)
        ph.run("leave", leave)
        ph.run("kill", kill)
    finally:
        ph.end()
        # Stay until the others are done with this rank's memory (the dead one cannot).
        with _quiet():
            store.add("sync/done", 1)
            deadline = time.monotonic() + SYNC_TIMEOUT_S
            while (
                int(store.add("sync/done", 0)) < ELASTIC_RANKS - 1 and time.monotonic() < deadline
            ):
                time.sleep(0.02)
        if "buf" in st and st["buf"].runtime is not None:
            st["buf"].explicitly_destroy = True
            st["buf"].destroy()


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return True


# ---------------------------------------------------------------------------- replicas group
def replicas_rank(rank: int, store_spec: tuple, conn) -> None:
    """Each rank holds a Buffer with replicas (opted in through MOECOMM_NIXL_EP_REPLICAS) and a
    plain one; rank 1 dies mid-round; the survivors' next rounds re-route its experts (replicas)
    or drop them (plain)."""
    import json

    torch.set_num_threads(1)
    store = open_store(store_spec)
    os.environ["MOECOMM_NIXL_EP_REPLICAS"] = json.dumps(REPLICAS)
    ph = Phases(conn)
    cap, victim = REPLICA_RANKS, REPLICA_VICTIM
    everyone = list(range(cap))
    survivors = [p for p in everyone if p != victim]
    st: dict = {}

    def connect():
        st["rep"] = new_buffer(rank, store, cap, store_prefix="rep")
        st["plain"] = new_buffer(rank, store, cap, store_prefix="plain", replicas={})
        for b in (st["rep"], st["plain"]):
            b.connect_ranks(everyone)
        hosted = sorted(e for e, rs in REPLICAS.items() if rank in rs)
        own = list(range(rank * L, (rank + 1) * L))
        assert st["rep"].local_experts == own + hosted
        assert st["plain"].local_experts == own

    def fault_free():
        outs = [
            round_trip(st[k], 80, everyone, cap, replicas=rep, use_fp8=fp8)
            for k, rep in (("rep", REPLICAS), ("plain", None))
            for fp8 in (False, True)
        ]
        assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])

    def kill():
        sync(store, "kill", cap)
        if rank == victim:
            for k in ("rep", "plain"):
                x, idx, _ = make_inputs(81, rank, M - (rank % 3), cap * L)
                st[k].dispatch(x, idx, M, None, use_fp8=False, return_recv_hook=True)
            conn.send(("kill", "ok", 0.0))
            os.kill(os.getpid(), signal.SIGKILL)
        for k, rep in (("rep", REPLICAS), ("plain", None)):
            round_trip(st[k], 81, everyone, cap, answered=survivors, replicas=rep)
            assert mask_of(st[k], cap) == [int(p == victim) for p in everyone]

    def after():
        x, idx, w = make_inputs(82, rank, M - (rank % 3), cap * L)
        fault_free_out = reference_combine(x, idx, w, False, lambda e: True)
        rep = round_trip(st["rep"], 82, survivors, cap, num_experts=cap * L, replicas=REPLICAS)
        plain = round_trip(st["plain"], 82, survivors, cap, num_experts=cap * L)
        routes_ = st["rep"]._route_for_test
        no_copy = torch.tensor([[e >= 0 and routes_[int(e)] == victim for e in r] for r in idx])
        complete = ~no_copy.any(dim=1)
        assert torch.equal(
            rep[complete].view(torch.int16), fault_free_out[complete].view(torch.int16)
        )
        # Not vacuous (fixed seeds): each survivor had copies re-routed, and one with no copy.
        rerouted = (idx >= 0) & (idx // L == victim) & ~no_copy
        assert bool(rerouted.any()) and bool(no_copy.any())
        assert not torch.equal(rep, plain)

    try:
        ph.run("connect", connect)
        ph.run("fault_free", fault_free)
        ph.run("kill", kill)
        ph.run("after", after)
    finally:
        ph.end()
        with _quiet():
            store.add("sync/done", 1)
            deadline = time.monotonic() + SYNC_TIMEOUT_S
            while int(store.add("sync/done", 0)) < cap - 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        for k in ("rep", "plain"):
            if k in st and st[k].runtime is not None:
                st[k].explicitly_destroy = True
                st[k].destroy()
