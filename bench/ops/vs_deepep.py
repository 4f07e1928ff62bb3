"""DeepEP's low-latency test shape through moecomm.compat.deep_ep, printed in DeepEP's style.

Shape (DeepEP tests/test_low_latency.py defaults): 128 tokens per rank, hidden 7168, top-8 of
288 experts, fp8 dispatch, bf16 combine; inputs built as DeepEP builds them (x ~ 0.1·N(0,1),
top-k of |N(0,1)|+1 scores, 10 entries masked to -1). Bytes, as DeepEP counts them: per selected
(token, k) ``hidden + hidden/128·4 + 16`` for the fp8 dispatch and ``hidden·2`` for the combine.
GB/s = bytes / time (10^9 B/s).

Each rank is a process on this host (default 2) using the shm host transport, one torch thread
each. A sample is the wall time of one call (dispatch, or combine, or the send and the receive
hook of each). We run --trials trials of --iters samples; the DeepEP-style lines give avg/min/max
over all samples, the table the median of the per-trial medians. The first combine of every rank
is checked against x·Σw (DeepEP's calc_diff < 7e-4 for fp8).

When ``deep_ep`` imports and CUDA has a device per rank, DeepEP's own Buffer runs the same inputs
in the same run (GPU rows); else they are reported as not run, with the reason. The last two table
rows are DeepEP's published figures (first-release README and today's docs/legacy.md, H800 +
CX7 400 Gb/s IB, EP 8) — not measured here.
Ratios are time / DeepEP's time measured in the same run (> 1: slower than DeepEP); without a
DeepEP run there are no ratios.

The moecomm GPU row: the same shape through moecomm's device path on one GPU. The client is
``moecomm.runtime.DeviceClient`` (fp8 dispatch, bf16 combine, 2 slots) in this process; the
server is ``moecomm expert-server --device cuda`` in a separate process on the same GPU (CUDA
cannot open its own IPC handle), hosting all experts of a one-layer random checkpoint of this
shape (expert MLP width --gpu-intermediate, bf16) written here first. A sample is the time
between CUDA events recorded around ``dispatch`` and around ``combine`` on the current stream,
synchronised after each step; ``combine`` includes the server's step (its expert MLP at that
width), which DeepEP's combine does not. The row checks the output against the same MLP computed
here (calc_diff below --gpu-diff-limit, which allows for the fp8 dispatch). Anything missing (no
device, the device API or server not built yet) prints the row as "not run: <reason>"; the host
rows are never affected. --gpu-only runs this row alone (tools/gpu_check.py uses it).

Usage: python bench/ops/vs_deepep.py [--num-processes 2] [--trials 5] [--iters 20] [--quick]
       [--gpu-only] [--json PATH]
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
from deepep_shape import calc_diff, deepep_bytes, deepep_inputs

# DeepEP README (first release), low-latency kernels, H800 + CX7 IB, EP 8, this shape.
PUBLISHED = {
    "name": "DeepEP published (H800, EP8; not run here)",
    "dispatch_us": 163.0,
    "dispatch_gbps": 46.0,
    "combine_us": 318.0,
    "combine_gbps": 46.0,
}
# The same shape in DeepEP's current V1 documentation (docs/legacy.md: H800 + CX7 400 Gb/s IB,
# EP 8; the low-latency kernels after their later optimizations). Context, not a contender.
PUBLISHED_V1_LATEST = {
    "name": "DeepEP V1 docs/legacy.md (H800, EP8; not run here)",
    "dispatch_us": 77.0,
    "dispatch_gbps": 98.0,
    "combine_us": 114.0,
    "combine_gbps": 127.0,
}
FP8_DIFF_LIMIT = 7e-4  # DeepEP's tolerance for an fp8 dispatch + bf16 combine round trip
RANK_TIMEOUT_S = 60.0


def _expert_outputs(buf, recv_x, count, hidden: int, device) -> torch.Tensor:
    """DeepEP's simulated GEMM: the dequantized received rows (rows past the counts: zero)."""
    data, scales = recv_x
    y = torch.zeros(data.shape, dtype=torch.bfloat16, device=device)
    for e in range(data.shape[0]):
        n = int(count[e])
        if n:
            rows = data[e, :n].float().view(n, -1, 128) * scales[e, :n].unsqueeze(2)
            y[e, :n] = rows.view(n, hidden).to(torch.bfloat16)
    return y


def run_rank(buf, a, rank: int, device="cpu", sync=lambda: None) -> dict:
    """The measurement loop, shared by the moecomm and the DeepEP ranks."""
    x, idx, w = (
        t.to(device) for t in deepep_inputs(rank, a.num_tokens, a.hidden, a.num_experts, a.num_topk)
    )
    m, e = a.num_tokens, a.num_experts
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, m, e, use_fp8=True)
    sync()
    y = _expert_outputs(buf, recv_x, count, a.hidden, device)
    out, _, _ = buf.low_latency_combine(y, idx, w, handle)
    sync()
    ref = x.float() * w.masked_fill(idx == -1, 0).sum(dim=1, keepdim=True)
    diff = calc_diff(ref.cpu(), out.float().cpu())
    got_hook = ("d_send", "d_recv", "c_send", "c_recv")
    samples = {k: [] for k in ("dispatch", "combine", *got_hook)}
    clock = time.perf_counter_ns
    for trial in range(a.warmup_trials + a.trials):
        got = {k: [] for k in samples}
        for i in range(a.iters):
            if i % 2 == 0:  # plain calls
                t0 = clock()
                h = buf.low_latency_dispatch(x, idx, m, e)[2]
                sync()
                t1 = clock()
                buf.low_latency_combine(y, idx, w, h)
                sync()
                t2 = clock()
                got["dispatch"].append(t1 - t0)
                got["combine"].append(t2 - t1)
            else:  # send, then the receive hook, of each
                t0 = clock()
                _, _, h, _, hook = buf.low_latency_dispatch(x, idx, m, e, return_recv_hook=True)
                t1 = clock()
                hook()
                sync()
                t2 = clock()
                hook = buf.low_latency_combine(y, idx, w, h, return_recv_hook=True)[2]
                t3 = clock()
                hook()
                sync()
                t4 = clock()
                for k, v in zip(got_hook, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    got[k].append(v)
        if trial >= a.warmup_trials:
            for k in samples:
                samples[k].append(got[k])
    d_bytes, c_bytes = deepep_bytes(idx.cpu(), a.hidden)
    return {
        "rank": rank,
        "samples_ns": samples,
        "dispatch_bytes": d_bytes,
        "combine_bytes": c_bytes,
        "calc_diff": diff,
    }


def moecomm_rank(rank: int, a, store_path: str, conn) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from moecomm.compat.deep_ep import Buffer

    try:
        store = dist.FileStore(store_path, a.num_processes)
        with Buffer(
            None,
            low_latency_mode=True,
            rank=rank,
            num_ranks=a.num_processes,
            store=store,
            num_max_dispatch_tokens_per_rank=a.num_tokens,
            hidden=a.hidden,
            num_experts=a.num_experts,
            num_topk=a.num_topk,
            timeout=RANK_TIMEOUT_S,
        ) as buf:
            conn.send(run_rank(buf, a, rank))
    except BaseException as exc:
        conn.send({"rank": rank, "error": repr(exc)})
        raise


def deepep_rank(rank: int, a, init_file: str, conn) -> None:
    """DeepEP's own Buffer on GPU `rank` (not exercised on a host without a GPU)."""
    import deep_ep
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", init_method=f"file://{init_file}", rank=rank, world_size=a.num_processes
        )
        group = dist.new_group(list(range(a.num_processes)))
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            a.num_tokens, a.hidden, a.num_processes, a.num_experts
        )
        buf = deep_ep.Buffer(
            group, 0, hint, low_latency_mode=True, num_qps_per_rank=a.num_experts // a.num_processes
        )
        conn.send(run_rank(buf, a, rank, device="cuda", sync=torch.cuda.synchronize))
        dist.destroy_process_group()
    except BaseException as exc:
        conn.send({"rank": rank, "error": repr(exc)})
        raise


def spawn_ranks(target, a, path: str) -> list[dict]:
    ctx = prefork.process_context()
    conns, procs = [], []
    for r in range(a.num_processes):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(r, a, path, child), daemon=True)
        p.start()
        child.close()
        conns.append(parent)
        procs.append(p)
    try:
        out = []
        for r, c in enumerate(conns):
            if not c.poll(a.rank_deadline):
                raise RuntimeError(f"rank {r} gave no result within {a.rank_deadline:.0f} s")
            out.append(c.recv())
        errors = [o for o in out if "error" in o]
        if errors:
            raise RuntimeError(f"ranks failed: {errors}")
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def gpu_skip_reason(num_ranks: int) -> str | None:
    """Every reason the GPU rows cannot run here, or None when they can."""
    reasons = []
    try:
        import deep_ep  # noqa: F401
    except ImportError as exc:
        reasons.append(f"deep_ep is not importable ({exc})")
    if not torch.cuda.is_available():
        reasons.append("no CUDA device (torch.cuda is not available)")
    elif torch.cuda.device_count() < num_ranks:
        reasons.append(f"{torch.cuda.device_count()} CUDA devices for {num_ranks} ranks")
    return "; ".join(reasons) or None


def summarize(name: str, ranks: list[dict]) -> dict:
    med = {}
    for k in ranks[0]["samples_ns"]:
        # Per rank: the median of the per-trial medians; across ranks: the slowest rank.
        med[k] = (
            max(percentile([percentile(t, 50) for t in r["samples_ns"][k]], 50) for r in ranks)
            / 1e3
        )
    d_bytes = sum(r["dispatch_bytes"] for r in ranks) / len(ranks)
    c_bytes = sum(r["combine_bytes"] for r in ranks) / len(ranks)
    return {
        "name": name,
        "dispatch_us": med["dispatch"],
        "combine_us": med["combine"],
        "dispatch_gbps": d_bytes / med["dispatch"] / 1e3,
        "combine_gbps": c_bytes / med["combine"] / 1e3,
        "d_send_us": med["d_send"],
        "d_recv_us": med["d_recv"],
        "c_send_us": med["c_send"],
        "c_recv_us": med["c_recv"],
        "max_calc_diff": max(r["calc_diff"] for r in ranks),
    }


def print_deepep_style(label: str, ranks: list[dict]) -> None:
    print(f"\n{label}")
    for r in ranks:
        s = {k: [v for t in trials for v in t] for k, trials in r["samples_ns"].items()}
        d, c = s["dispatch"], s["combine"]
        both = [x + y for x, y in zip(d, c, strict=True)]
        db, cb = r["dispatch_bytes"], r["combine_bytes"]
        avg = lambda v: sum(v) / len(v) / 1e9  # noqa: E731  seconds
        print(
            f"[rank {r['rank']}] Dispatch + combine bandwidth: {(db + cb) / 1e9 / avg(both):.2f}"
            f" GB/s, avg_t={avg(both) * 1e6:.2f} us, min_t={min(both) / 1e3:.2f} us, "
            f"max_t={max(both) / 1e3:.2f} us"
        )
        print(
            f"[rank {r['rank']}] Dispatch bandwidth: {db / 1e9 / avg(d):.2f} GB/s, "
            f"avg_t={avg(d) * 1e6:.2f} us | Combine bandwidth: {cb / 1e9 / avg(c):.2f} GB/s, "
            f"avg_t={avg(c) * 1e6:.2f} us"
        )
        print(
            f"[rank {r['rank']}] Dispatch send/recv time: {avg(s['d_send']) * 1e6:.2f} + "
            f"{avg(s['d_recv']) * 1e6:.2f} us | Combine send/recv time: "
            f"{avg(s['c_send']) * 1e6:.2f} + {avg(s['c_recv']) * 1e6:.2f} us"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--num-tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--num-topk", type=int, default=8)
    ap.add_argument("--num-experts", type=int, default=288)
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--warmup-trials", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20, help="samples per trial (half with hooks)")
    ap.add_argument("--quick", action="store_true", help="small shape and few samples (tests)")
    ap.add_argument(
        "--gpu-only",
        action="store_true",
        help="only the moecomm GPU row (and the published figures); no host ranks",
    )
    ap.add_argument(
        "--gpu-intermediate",
        type=int,
        default=64,
        help="expert MLP width of the GPU row's random checkpoint (the server computes it)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--modes-tokens", dest="tokens", type=int, default=512,
        help="normal mode / ElasticBuffer rows: tokens per rank",
    )  # fmt: skip
    a = ap.parse_args(argv)
    if a.quick:
        a.num_tokens, a.hidden, a.num_experts, a.trials, a.iters = 16, 1024, 16, 2, 4
        a.tokens = 32
    a.rank_deadline = 300.0
    torch.set_num_threads(1)
    print(
        f"low-latency shape: {a.num_tokens} tokens/rank, hidden {a.hidden}, top-{a.num_topk} "
        f"of {a.num_experts} experts, fp8 dispatch, bf16 combine, "
        + ("moecomm GPU row only" if a.gpu_only else f"{a.num_processes} ranks")
    )
    rows, results = [], {}
    deepep_row = None
    deepep_reason = gpu_skip_reason(a.num_processes)
    with tempfile.TemporaryDirectory() as tmp:
        if not a.gpu_only:
            ranks = spawn_ranks(moecomm_rank, a, os.path.join(tmp, "store"))
            print_deepep_style(
                f"moecomm.compat.deep_ep, host shm, {a.num_processes} processes", ranks
            )
            rows.append(summarize(f"moecomm host shm, {a.num_processes} procs (this run)", ranks))
            results["moecomm"] = ranks
            if deepep_reason is None:
                gpu = spawn_ranks(deepep_rank, a, os.path.join(tmp, "nccl-init"))
                print_deepep_style(f"DeepEP Buffer, {a.num_processes} GPUs", gpu)
                deepep_row = summarize(f"DeepEP, {a.num_processes} GPUs (this run)", gpu)
                rows.append(deepep_row)
                results["deep_ep"] = gpu
            else:
                print(f"\nGPU rows not run: {deepep_reason}")
        # The server's log: next to the JSON when there is one (gpu-check keeps it).
        log_dir = os.path.dirname(os.path.abspath(a.json)) if a.json else tmp
        from vs_deepep_gpu import moecomm_gpu_row

        gpu_row = moecomm_gpu_row(a, tmp, log_dir)
    if "not_run" in gpu_row:
        print(f"\n{gpu_row['name']}: not run: {gpu_row['not_run']}")
    else:
        results["moecomm_gpu"] = gpu_row.pop("samples_ns")
        rows.append(gpu_row)
    # Ratios only against DeepEP measured in this same run: a published figure from another
    # machine and rank count is context, not a contender.
    for r in rows:
        if deepep_row is not None:
            r["dispatch_ratio"] = r["dispatch_us"] / deepep_row["dispatch_us"]
            r["combine_ratio"] = r["combine_us"] / deepep_row["combine_us"]
        limit = r.get("diff_limit", FP8_DIFF_LIMIT)
        r["ok"] = "yes" if r["max_calc_diff"] < limit else "NO"
    if "not_run" in gpu_row:
        rows.append({"name": gpu_row["name"].replace("(this run)", "(not run: see below)")})
    rows.extend([PUBLISHED, PUBLISHED_V1_LATEST])
    if deepep_row is None:
        print("\nmedians (slowest rank); no ratios: DeepEP did not run in this run (the published")
        print("rows are other machines and rank counts, shown for context only)")
    else:
        print(f"\nmedians (slowest rank); ratios = time / {deepep_row['name']}")
    print(
        format_table(
            rows,
            [
                ("name", "contender", ""),
                ("dispatch_us", "dispatch µs", ".1f"),
                ("dispatch_gbps", "GB/s", ".2f"),
                ("combine_us", "combine µs", ".1f"),
                ("combine_gbps", "GB/s", ".2f"),
                ("dispatch_ratio", "disp ratio", ".1f"),
                ("combine_ratio", "comb ratio", ".1f"),
                ("d_send_us", "d send", ".0f"),
                ("d_recv_us", "d recv", ".0f"),
                ("c_send_us", "c send", ".0f"),
                ("c_recv_us", "c recv", ".0f"),
                ("ok", "ok", ""),
            ],
        )
    )
    if "not_run" in gpu_row:
        print(f"moecomm GPU row: not run: {gpu_row['not_run']}")
    else:
        print(
            "moecomm GPU row: combine includes the server's expert MLP "
            f"(width {a.gpu_intermediate}); DeepEP's combine does not"
        )
    modes = None
    if not a.gpu_only:  # DeepEP's normal mode and EPv2's ElasticBuffer (bench/ops/deepep_modes.py)
        from deepep_modes import print_modes, run_modes

        modes = run_modes(a)
        print_modes(modes, a)
    write_json(
        a.json,
        {
            "benchmark": "vs_deepep",
            "args": {k: v for k, v in vars(a).items()},
            "rows": rows,
            "gpu_not_run": deepep_reason,
            "gpu_row": gpu_row,
            "ranks": results,
            "modes": modes,
        },
    )
    ok = all(r.get("ok", "yes") == "yes" for r in rows)
    return 0 if ok and (modes is None or modes["exact"]) else 1


if __name__ == "__main__":
    sys.exit(main())
