"""DeepEP's normal (high-throughput) mode and EPv2's ElasticBuffer through moecomm.compat.deep_ep,
on the host transport: rank processes on this machine, one torch thread each.

Shape (prefill-like, scaled to a 2-core CPU): --tokens per rank (default 512), hidden 7168,
top-8 of 288 experts, bf16; DeepEP builds the same inputs (x ~ 0.1·N(0,1), top-k of |N(0,1)|+1
scores with 10 entries masked to -1). A sample is the wall time of one call. Each mode's first
combine is checked: experts are the identity, so the normal combine (a plain sum over the ranks a
token went to, no weights: DeepEP's semantics) must return x times that rank count, bit for bit
in f32 before the bf16 cast.

Rows: normal dispatch (layout given), normal cached dispatch (handle reused), normal combine,
ElasticBuffer dispatch and combine. There is no DeepEP run here (no GPU); the ratios are between
moecomm's own calls and the low-latency row of bench/ops/vs_deepep.py is separate.

Usage: python bench/ops/deepep_modes.py [--num-processes 2] [--tokens 512] [--trials 5] [--iters 6]
       [--quick] [--json PATH]     (also run by bench/ops/vs_deepep.py unless --gpu-only)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from moecomm import prefork

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
from _lib.common import format_table, percentile, write_json

RANK_TIMEOUT_S = 120.0


def inputs(rank: int, tokens: int, hidden: int, experts: int, topk: int, seed: int = 1):
    """DeepEP's test inputs (as bench/ops/vs_deepep.py builds them)."""
    g = torch.Generator().manual_seed(seed + rank)
    x = (torch.randn(tokens, hidden, generator=g) * 0.1).to(torch.bfloat16)
    scores = torch.randn(tokens, experts, generator=g).abs() + 1
    w, idx = torch.topk(scores, topk, dim=-1)
    mask = torch.randperm(tokens * topk, generator=g)[: min(10, tokens * topk)]
    idx.view(-1)[mask] = -1
    return x, idx.to(torch.int64), w.float()


def _ranks_hit(idx: torch.Tensor, num_ranks: int, experts: int) -> torch.Tensor:
    per = experts // num_ranks
    hit = torch.zeros(idx.shape[0], num_ranks, dtype=torch.bool)
    for k in range(idx.shape[1]):
        e = idx[:, k]
        ok = e >= 0
        hit[ok.nonzero().flatten(), (e[ok] // per)] = True
    return hit.sum(dim=1, keepdim=True).float()


def _time(fn) -> int:
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


def modes_rank(rank: int, a, store_dir: str, conn) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from moecomm.compat.deep_ep import Buffer
    from moecomm.compat.elastic import ElasticBuffer

    try:
        n = a.num_processes
        x, idx, w = inputs(rank, a.tokens, a.hidden, a.num_experts, a.num_topk)
        expect = (x.float() * _ranks_hit(idx, n, a.num_experts)).to(torch.bfloat16)
        out = {"rank": rank, "samples_ns": {}}
        store = dist.FileStore(os.path.join(store_dir, "normal"), n)
        with Buffer(None, low_latency_mode=False, rank=rank, num_ranks=n, store=store,
                    timeout=RANK_TIMEOUT_S) as buf:  # fmt: skip
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, a.num_experts)

            def dispatch():
                return buf.dispatch(x, None, per_rank, None, in_rank, per_expert, idx, w)

            recv_x, _, _, _, handle, _ = dispatch()
            got = buf.combine(recv_x, handle)[0]
            out["normal_exact"] = bool(torch.equal(got, expect))
            s = {"normal dispatch": [], "normal cached dispatch": [], "normal combine": []}
            for trial in range(a.warmup_trials + a.trials):
                cur = {k: [] for k in s}
                for _ in range(a.iters):
                    cur["normal dispatch"].append(_time(dispatch))
                    cur["normal cached dispatch"].append(_time(lambda: buf.dispatch(x, handle)))
                    cur["normal combine"].append(_time(lambda: buf.combine(recv_x, handle)))
                if trial >= a.warmup_trials:
                    for k in s:
                        s[k].append(cur[k])
            out["samples_ns"].update(s)
        store = dist.FileStore(os.path.join(store_dir, "elastic"), n)
        eb = ElasticBuffer(None, num_max_tokens_per_rank=a.tokens, hidden=a.hidden,
                           num_topk=a.num_topk, rank=rank, num_ranks=n, store=store,
                           timeout=RANK_TIMEOUT_S)  # fmt: skip
        try:
            recv_x, _, _, h, _ = eb.dispatch(x, idx, w, num_experts=a.num_experts)
            s = {"elastic dispatch": [], "elastic combine": []}
            for trial in range(a.warmup_trials + a.trials):
                cur = {k: [] for k in s}
                for _ in range(a.iters):
                    cur["elastic dispatch"].append(
                        _time(lambda: eb.dispatch(x, idx, w, num_experts=a.num_experts))
                    )
                    cur["elastic combine"].append(_time(lambda: eb.combine(recv_x, h)))
                if trial >= a.warmup_trials:
                    for k in s:
                        s[k].append(cur[k])
            out["samples_ns"].update(s)
        finally:
            eb.destroy()
        conn.send(out)
    except BaseException as exc:
        conn.send({"rank": rank, "error": repr(exc)})
        raise


def run_modes(a) -> dict:
    """Runs the modes on a.num_processes ranks; returns {"rows": [...], "exact": bool}."""
    ctx = prefork.process_context()
    with tempfile.TemporaryDirectory(prefix="moecomm-modes-") as tmp:
        conns, procs = [], []
        for r in range(a.num_processes):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=modes_rank, args=(r, a, tmp, child), daemon=True)
            p.start()
            conns.append(parent)
            procs.append(p)
        results = []
        try:
            for r, c in enumerate(conns):
                if not c.poll(RANK_TIMEOUT_S * 4):
                    raise RuntimeError(f"rank {r} gave no result")
                results.append(c.recv())
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"modes benchmark failed: {errors}")
    rows = []
    for name in results[0]["samples_ns"]:
        # median over ranks of the median over trials of the per-trial medians
        per_rank = [
            percentile([percentile(t, 50) for t in r["samples_ns"][name]], 50) for r in results
        ]
        rows.append({"name": name, "median_us": max(per_rank) / 1e3})
    base = {r["name"]: r["median_us"] for r in rows}
    for r in rows:
        ref = base["normal dispatch"] if "dispatch" in r["name"] else base["normal combine"]
        r["ratio_to_normal"] = r["median_us"] / ref
    return {"rows": rows, "exact": all(r["normal_exact"] for r in results)}


def print_modes(res: dict, a) -> None:
    print(
        f"\nDeepEP normal mode / EPv2 ElasticBuffer on moecomm (host transport, {a.num_processes} "
        f"ranks, {a.tokens} tokens/rank, hidden {a.hidden}, top-{a.num_topk} of {a.num_experts}, "
        f"bf16); combine exact: {res['exact']}"
    )
    cols = [
        ("name", "call", "s"),
        ("median_us", "median µs (slowest rank)", ".0f"),
        ("ratio_to_normal", "× normal call", ".2f"),
    ]
    print(format_table(res["rows"], cols))


def add_mode_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokens", type=int, default=512, help="normal mode: tokens per rank")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--num-topk", type=int, default=8)
    ap.add_argument("--num-experts", type=int, default=288)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--warmup-trials", type=int, default=1)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    add_mode_args(ap)
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.hidden, a.num_experts, a.trials, a.iters = 32, 256, 16, 1, 2
    res = run_modes(a)
    print_modes(res, a)
    if a.json:
        write_json(a.json, {"args": vars(a), **res})
    return 0 if res["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
