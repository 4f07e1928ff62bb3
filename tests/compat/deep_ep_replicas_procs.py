"""Rank processes for test_deep_ep_replicas.py: moecomm's ``replicas=`` extension of the
DeepEP-shaped Buffer's shrink mode, against a plain shrink Buffer (``replicas=None``, DeepEP's
semantics) on the same inputs.

Every rank regenerates every rank's inputs from the seed. The "experts" are seeded per-expert
scales (``y = bf16(x * s_e)``), computed per local slot from ``buf.local_experts``: the answer
for an expert is the same whichever rank (primary or replica) computes it, so the re-routed
combine must equal the fault-free one bit for bit.

Failure injection as the shrink contract test's: rank ``DEAD`` stops calling from the second
dispatch on; the others time out on it during that dispatch's receive and mask it.
"""

from __future__ import annotations

import time
import traceback

import torch

NUM_RANKS, HIDDEN, NUM_EXPERTS, TOPK, TOKENS = 4, 512, 16, 4, 6
L = NUM_EXPERTS // NUM_RANKS
DEAD = 1
# Rank 1's experts 4..7: 4 and 5 have live replicas (5: first choice rank 3, then 0), 6's only
# replica is on rank 0, 7 has none (dropped). 9's replica is on the dead rank (never used).
REPLICAS = {4: [2], 5: [3, 0], 6: [0], 0: [3], 9: [1]}
SHRINK_TIMEOUT_S = 3.0
SETUP_TIMEOUT_S = 30.0
SEED = 7


def inputs(rank: int):
    g = torch.Generator().manual_seed(SEED * 1009 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOPK] for _ in range(TOKENS)])
    idx[0, 1] = -1
    w = torch.rand(TOKENS, TOPK, generator=g)
    return x, idx.to(torch.int64), w


def scale(e: int) -> float:
    return 1.0 + 0.125 * e


def expert(rows: torch.Tensor, e: int) -> torch.Tensor:
    return (rows.float() * scale(e)).to(torch.bfloat16)


def reference(x, idx, w, keep) -> torch.Tensor:
    """Σ_k w[t, k] · y_e(x[t]) in f32, k ascending, over the (t, k) with idx >= 0 and keep."""
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(idx.shape[1]):
        e = idx[:, k]
        y = torch.stack([expert(x[t], int(e[t])) for t in range(x.shape[0])]).float()
        valid = (e >= 0) & keep[:, k]
        acc = torch.where(valid[:, None], acc + w[:, k : k + 1] * y, acc)
    return acc.to(torch.bfloat16)


def route(e: int, dead: set) -> int | None:
    """The rank expert e's copies go to with `dead` masked (None: no live copy)."""
    for q in [e // L, *REPLICAS.get(e, [])]:
        if q not in dead:
            return q
    return None


def compute(buf, recv_x, count) -> torch.Tensor:
    """The engine: every local slot's rows through its logical expert."""
    y = torch.zeros(recv_x.shape, dtype=torch.bfloat16)
    for i, e in enumerate(buf.local_experts):
        n = int(count[i])
        y[i, :n] = expert(recv_x[i, :n], e)
    return y


def round_trip(buf, x, idx, w):
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(
        x, idx, TOKENS, NUM_EXPERTS, use_fp8=False
    )
    out, _, _ = buf.low_latency_combine(compute(buf, recv_x, count), idx, w, handle)
    return recv_x, count, handle, out


def check_received(buf, recv_x, count, rank: int, dead: set) -> None:
    """Each local slot holds the rows routed to this rank, source rank major, token ascending."""
    for i, e in enumerate(buf.local_experts):
        want = []
        for p in range(NUM_RANKS):
            if p in dead:
                continue
            xp, ip, _ = inputs(p)
            want += [xp[t] for t in range(TOKENS) if e in ip[t].tolist()]
        if route(e, dead) != rank:
            want = []
        assert int(count[i]) == len(want), (rank, e, int(count[i]), len(want))
        if want:
            assert torch.equal(recv_x[i, : len(want)], torch.stack(want)), (rank, e)


def scenario(rank: int, rep, plain, stats: dict) -> None:
    x, idx, w = inputs(rank)
    all_keep = torch.ones(idx.shape, dtype=torch.bool)
    fault_free = reference(x, idx, w, all_keep)
    local = list(range(rank * L, (rank + 1) * L))
    hosted = sorted(e for e, rs in REPLICAS.items() if rank in rs)

    # (a) + (c): nobody masked. Same results with and without replicas; DeepEP's shapes without.
    rx_r, cnt_r, h_r, out_r = round_trip(rep, x, idx, w)
    rx_p, cnt_p, h_p, out_p = round_trip(plain, x, idx, w)
    assert plain.local_experts == local
    assert tuple(rx_p.shape) == (L, NUM_RANKS * TOKENS, HIDDEN)
    assert tuple(cnt_p.shape) == (L,) and tuple(h_p[0].shape) == (L, NUM_RANKS * TOKENS)
    assert tuple(h_p[1].shape) == (L, NUM_RANKS)
    assert tuple(plain.get_next_low_latency_combine_buffer(h_p).shape) == tuple(rx_p.shape)
    assert rep.local_experts == local + hosted
    n = L + len(hosted)
    assert tuple(rx_r.shape) == (n, NUM_RANKS * TOKENS, HIDDEN) and tuple(cnt_r.shape) == (n,)
    assert tuple(h_r[0].shape) == (n, NUM_RANKS * TOKENS) and tuple(h_r[1].shape) == (n, NUM_RANKS)
    assert torch.equal(cnt_r[:L], cnt_p) and int(cnt_r[L:].sum()) == 0
    assert tuple(rep.get_next_low_latency_combine_buffer(h_r).shape) == tuple(rx_r.shape)
    (q, sc), cnt_q, _, _, _ = rep.low_latency_dispatch(x, idx, TOKENS, NUM_EXPERTS)  # fp8
    assert tuple(q.shape) == tuple(rx_r.shape) and torch.equal(cnt_q, cnt_r)
    assert tuple(sc.shape) == (n, NUM_RANKS * TOKENS, HIDDEN // 128)
    check_received(rep, rx_r, cnt_r, rank, set())
    check_received(plain, rx_p, cnt_p, rank, set())
    assert torch.equal(out_r.view(torch.int16), fault_free.view(torch.int16))
    assert torch.equal(out_p.view(torch.int16), fault_free.view(torch.int16))

    # (b) rank DEAD stops calling: masked by the others during this dispatch's receive. Its
    # copies of this dispatch were sent before anyone knew: dropped by both buffers.
    if rank == DEAD:
        return
    on_dead = (idx >= 0) & (idx // L == DEAD)
    for buf in (rep, plain):
        buf.timeout = SHRINK_TIMEOUT_S
        _, _, _, out = round_trip(buf, x, idx, w)
        status = torch.zeros(NUM_RANKS, dtype=torch.int)
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [int(p == DEAD) for p in range(NUM_RANKS)]
        assert torch.equal(out.view(torch.int16), reference(x, idx, w, ~on_dead).view(torch.int16))

    # The mask is known: the next dispatch re-routes (replicas) or drops (plain shrink).
    dropped = (rep.dropped_copies, plain.dropped_copies)
    rx_r, cnt_r, _, out_r = round_trip(rep, x, idx, w)
    rx_p, cnt_p, _, out_p = round_trip(plain, x, idx, w)
    no_copy = on_dead & torch.tensor([[route(int(e), {DEAD}) is None for e in r] for r in idx])
    check_received(rep, rx_r, cnt_r, rank, {DEAD})
    check_received(plain, rx_p, cnt_p, rank, {DEAD})
    assert torch.equal(out_r.view(torch.int16), reference(x, idx, w, ~no_copy).view(torch.int16))
    assert torch.equal(out_p.view(torch.int16), reference(x, idx, w, ~on_dead).view(torch.int16))
    complete = ~no_copy.any(dim=1)  # tokens whose experts all have a live copy
    assert torch.equal(out_r[complete].view(torch.int16), fault_free[complete].view(torch.int16))
    assert rep.dropped_copies - dropped[0] == int(no_copy.sum())
    assert plain.dropped_copies - dropped[1] == int(on_dead.sum())
    stats["rerouted"] = int((on_dead & ~no_copy).sum())
    stats["dropped"] = int(no_copy.sum())
    stats["served_as_replica"] = int(cnt_r[L:].sum())


def replicas_rank(rank: int, num_ranks: int, store_path: str, names: list[str], conn) -> None:
    """deep_ep_procs.launch target: both Buffers, the scenario, ``{name: (status, stats)}``."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    from moecomm.compat.deep_ep import Buffer

    store = dist.FileStore(store_path, num_ranks)
    stats: dict = {}
    bufs = []
    status = "ok"
    try:
        for prefix, replicas in (("rep", REPLICAS), ("plain", None)):
            bufs.append(
                Buffer(
                    None,
                    low_latency_mode=True,
                    enable_shrink=True,
                    rank=rank,
                    num_ranks=num_ranks,
                    store=store,
                    store_prefix=prefix,
                    timeout=SETUP_TIMEOUT_S,
                    num_max_dispatch_tokens_per_rank=TOKENS,
                    hidden=HIDDEN,
                    num_experts=NUM_EXPERTS,
                    num_topk=TOPK,
                    replicas=replicas,
                )
            )
        scenario(rank, *bufs, stats)
    except BaseException:
        status = traceback.format_exc()
    finally:
        # The dead rank stops calling: it waits, its buffers open, until the live ones are done.
        store.add("done", 1)
        deadline = time.monotonic() + 60
        while int(store.add("done", 0)) < num_ranks and time.monotonic() < deadline:
            time.sleep(0.05)
        for b in bufs:
            b.destroy()
    conn.send({name: (status, stats) for name in names})
