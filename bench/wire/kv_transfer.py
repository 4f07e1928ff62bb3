"""KV hand-off time vs KV size over shm (moecomm.wire.kv), beside memcpy of the same bytes, into
the library's shm pool and into an engine's own tensors (cross-memory attach).

Two processes: this one owns the sending pool, a spawned child the receiving pool. For each size
and each block pattern, the child reserves destination blocks (``expect``) and passes the request
over a pipe (not timed); the sender then writes every layer and part (``send``) and the child's
wait returns. The *hand-off* is the time from the sender's start to the receiver's wait
returning (both read CLOCK_MONOTONIC, which is one clock for the whole host). Contenders, in
the same run:

- ``memcpy``: one libc ``memcpy`` (one thread) of the same number of bytes between two
  pre-touched buffers of this process, sampled just before each hand-off of the first pattern
  (so both see the same load): the floor of any copy that moves each byte once;
- ``kv contiguous``: source and destination blocks in one run each (a fresh pool): one copy per
  layer and part;
- ``kv scattered``: random source and destination blocks (a fragmented pool): one copy per block,
  layer and part;
- ``cma contiguous`` / ``cma scattered``: the same two patterns into the receiver's *engine-owned*
  tensors (``KvPool(..., tensors=...)``, vLLM's ``[2, num_blocks, ...]`` per layer): one
  ``process_vm_writev`` per layer, one iovec per run and part, each byte copied once;
- ``shm+copy contiguous`` / ``shm+copy scattered``: the alternative for engine-owned tensors:
  the blocks land in the library's shm pool, then the receiver copies them into its engine
  tensors (one ``memmove`` per run and part, from Python) before its wait returns: one extra
  copy of every byte;
- ``staged``: today's reference-serving shape, random blocks: gather every part's blocks
  (``index_select``), one flat buffer (``cat``), 2 MiB chunks through a stage channel into the
  receiver's slots, copied out and joined there, scattered into its pool: about five copies of
  each byte (the serving's HTTP handshake and per-block device copies left out).

Bytes moved = blocks × (bytes of one block over every layer and part). Bandwidth = bytes / median
hand-off (GB/s, 10^9 B/s); ratio = kv bandwidth / memcpy bandwidth (goal: ≥ 0.5 for ≥ 1 MiB).
``*_send_us`` is the sender's part alone (writes and signals, without the receiver's wake-up):
on a host with more busy processes than cores the wake-up, not the copy, dominates small sizes.
The load average is recorded before and after: on a shared machine the figures move with it.

Usage: python bench/wire/kv_transfer.py [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import sys
import time

import torch
from moecomm import prefork

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
from _lib.common import format_table, percentile, write_json
from moecomm.wire.kv import KvLayout, KvPool, block_runs
from moecomm.wire.shm import ShmTransport
from moecomm.wire.stage import StageInbox, StageReceiver, StageSender, stage_layout

# Two layers, K and V, 16 tokens x 2 heads x 64 wide in bf16: 4 KiB per part and block, 16 KiB
# per block over the pool, so 16 KiB ... 64 MiB is 1 ... 4096 blocks.
LAYERS = 2
PARTS = {"k": (16, 2, 64), "v": (16, 2, 64)}
DTYPE = torch.bfloat16
SIZES_KIB = [16, 64, 256, 1024, 4096, 16384, 65536]
QUICK_SIZES_KIB = [16, 1024, 16384]
ITERS = 15
QUICK_ITERS = 4
WARMUP = 2
# Fewer repetitions of the largest sizes: a 64 MiB hand-off on a loaded host takes tens of ms.
BIG_KIB = 16384
BIG_ITERS = 6
GOAL_RATIO = 0.5
GOAL_MIN_KIB = 1024
# Each pipe exchange with the receiver gets this long (a loaded host can stall a process).
PIPE_TIMEOUT_S = 120.0
PATTERNS = ("contiguous", "scattered")
# Into engine-owned tensors: written there directly (cma), or into the shm pool and copied.
ENGINE_CONTENDERS = ("cma", "shm_copy")
# The staged contender: the reference serving's KV channel (serving/.../disagg/transfer.py:
# 2 MiB chunks, 4 slots) rebuilt from the library's stage channel, without its HTTP handshake.
STAGED_SLOT_BYTES = 2 << 20
STAGED_SLOTS = 4
STAGED_CLIENT_ID = 7


def layout(num_blocks: int) -> KvLayout:
    return KvLayout.paged(LAYERS, num_blocks, DTYPE, PARTS)


def receiver(conn, num_blocks: int) -> None:
    """The receiving end: reserve, hand over the request, wait, report when the wait returned."""
    pool = KvPool(ShmTransport(), layout(num_blocks))
    engine = KvPool(pool.transport, layout(num_blocks), tensors=engine_tensors(num_blocks))
    for kv in (pool, engine):  # touch every page once: the timed runs measure copies only
        for p in kv.layout.parts:
            kv.view(p.layer, p.name).zero_()
    inbox = StageInbox(pool.transport)
    stage = StageReceiver(pool.transport, staged_layout(), STAGED_CLIENT_ID, STAGED_SLOTS)
    conn.send((pool.info().to_json(), engine.info().to_json(), stage.handle, inbox.doorbell_handle))
    pool_info, stage_sender = conn.recv()
    link = pool.connect(pool_info)
    engine_link = engine.connect(pool_info)
    stage.connect(stage_sender)
    inbox.add("bench", stage)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if isinstance(msg, tuple) and msg[0] in ENGINE_CONTENDERS:  # (contender, dst)
            kind, dst = msg
            with (engine_link if kind == "cma" else link).expect(dst) as recv:
                conn.send(recv.request.to_json())
                recv.wait(PIPE_TIMEOUT_S)
                if kind == "shm_copy":
                    copy_into(engine, pool, dst)
                conn.send(time.perf_counter_ns())
            continue
        if isinstance(msg, tuple):  # ("staged", tag, dst): the reference serving's shape
            _, tag, dst = msg
            conn.send("ready")
            _, data = inbox.take("bench", tag, PIPE_TIMEOUT_S)  # copied out of the slots
            scatter(pool, dst, data)
            conn.send(time.perf_counter_ns())
            continue
        with link.expect(msg) as recv:
            conn.send(recv.request.to_json())
            recv.wait(PIPE_TIMEOUT_S)
            conn.send(time.perf_counter_ns())
    link.close()
    engine_link.close()
    inbox.close()
    engine.close()
    pool.close()


def engine_tensors(num_blocks: int) -> list[torch.Tensor]:
    """An engine's own KV tensors, vLLM's shape: one ``[2, num_blocks, *block]`` per layer,
    registered as its K and V parts."""
    out = []
    for _ in range(LAYERS):
        kv = torch.empty(len(PARTS), num_blocks, *PARTS["k"], dtype=DTYPE)
        out += [kv[j] for j in range(len(PARTS))]
    return out


def copy_into(engine: KvPool, pool: KvPool, dst: list[int]) -> None:
    """The shm+copy contender's extra step: `dst` blocks from the shm pool into the engine's
    tensors, one memmove per run of consecutive blocks and part."""
    runs = block_runs(dst, dst)
    for i, p in enumerate(pool.layout.parts):
        bb = p.block_bytes
        src, to, stride = pool.part_address(i), engine.part_address(i), engine.block_stride(i)
        assert stride == bb  # engine_tensors() keeps each part's blocks contiguous
        for d, _, n in runs:
            ctypes.memmove(to + d * bb, src + d * bb, n * bb)


def staged_layout():
    """The reference serving's KV channel: 2 MiB chunks of whole 4 KiB rows (disagg/transfer)."""
    return stage_layout(STAGED_SLOT_BYTES // 4096, 1024, "f32")


def gather(pool: KvPool, src: list[int]) -> torch.Tensor:
    """The staged path's sending side: every part's blocks gathered, then one flat buffer."""
    idx = torch.tensor(src)
    return torch.cat(
        [
            pool.view(p.layer, p.name).index_select(0, idx).reshape(-1).view(torch.uint8)
            for p in pool.layout.parts
        ]
    )


def scatter(pool: KvPool, dst: list[int], data: torch.Tensor) -> None:
    """The staged path's receiving side: the flat buffer scattered into the pool's blocks."""
    idx, offset = torch.tensor(dst), 0
    for p in pool.layout.parts:
        v = pool.view(p.layer, p.name)
        nbytes = len(dst) * p.block_bytes
        v[idx] = data[offset : offset + nbytes].view(v.dtype).view(len(dst), *p.block_shape)
        offset += nbytes


def ask(conn, msg):
    conn.send(msg)
    if not conn.poll(PIPE_TIMEOUT_S):
        raise TimeoutError("the receiving process did not answer")
    return conn.recv()


def memcpy_once(src: torch.Tensor, dst: torch.Tensor, nbytes: int) -> int:
    """One timed libc memcpy of `nbytes` between two pre-touched buffers of this process (one
    thread, as the transfer's copies are; torch's copy_ would split a large copy over threads)."""
    t0 = time.perf_counter_ns()
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    return time.perf_counter_ns() - t0


def run(
    sizes_kib: list[int], iters: int, seed: int, staged: bool = True, engine: bool = True
) -> dict:
    block_bytes = layout(1).block_bytes
    num_blocks = max(sizes_kib) * 1024 // block_bytes
    transport = ShmTransport()
    pool = KvPool(transport, layout(num_blocks))
    for p in pool.layout.parts:
        v = pool.view(p.layer, p.name)
        v.copy_(torch.randn(v.shape).to(v.dtype))
    ctx = prefork.process_context()
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=receiver, args=(child_conn, num_blocks), daemon=True)
    child.start()
    rng = random.Random(seed)
    rows = []
    tag = 0
    floor_src = torch.randint(0, 255, (num_blocks * block_bytes,), dtype=torch.uint8)
    floor_dst = torch.ones(num_blocks * block_bytes, dtype=torch.uint8)
    try:
        if not conn.poll(PIPE_TIMEOUT_S):
            raise TimeoutError("the receiving process did not start")
        info, engine_info, stage_handle, doorbell = conn.recv()
        link = pool.connect(info)
        engine_link = pool.connect(engine_info)
        stage = StageSender(transport, staged_layout(), STAGED_CLIENT_ID, STAGED_SLOTS)
        stage.connect(stage_handle, doorbell)
        conn.send((pool.info().to_json(), stage.handle))
        # One full transfer first: maps every page of the receiver's pool in this process.
        request = ask(conn, list(range(num_blocks)))
        link.send(request, list(range(num_blocks)))
        if not conn.poll(PIPE_TIMEOUT_S):
            raise TimeoutError("the receiver's wait did not return")
        conn.recv()
        request = ask(conn, ("cma", list(range(num_blocks))))  # touches the engine's pages too
        engine_link.send(request, list(range(num_blocks)))
        if not conn.poll(PIPE_TIMEOUT_S):
            raise TimeoutError("the receiver's wait did not return")
        conn.recv()
        for kib in sizes_kib:
            n = kib * 1024 // block_bytes
            nbytes = n * block_bytes
            reps = BIG_ITERS if kib >= BIG_KIB and iters > BIG_ITERS else iters
            row = {"kib": kib, "blocks": n, "bytes": nbytes}
            mc = []
            for contender, pattern in [(None, p) for p in PATTERNS] + [
                (c, p) for c in (ENGINE_CONTENDERS if engine else ()) for p in PATTERNS
            ]:
                name = pattern if contender is None else f"{contender}_{pattern}"
                target = engine_link if contender == "cma" else link
                samples, send_samples = [], []
                for i in range(WARMUP + reps):
                    if pattern == "contiguous":
                        src, dst = list(range(n)), list(range(n))
                    else:
                        src, dst = (
                            rng.sample(range(num_blocks), n),
                            rng.sample(range(num_blocks), n),
                        )
                    # The floor is sampled beside each hand-off, so both see the same load.
                    copy_ns = memcpy_once(floor_src, floor_dst, nbytes)
                    request = ask(conn, dst if contender is None else (contender, dst))
                    t0 = time.perf_counter_ns()
                    target.send(request, src)
                    t_sent = time.perf_counter_ns()
                    if not conn.poll(PIPE_TIMEOUT_S):
                        raise TimeoutError("the receiver's wait did not return")
                    t1 = conn.recv()
                    if i >= WARMUP:
                        mc.append(copy_ns)
                        samples.append(t1 - t0)
                        send_samples.append(t_sent - t0)
                if "memcpy_us" not in row:  # the floor from the first pattern's samples
                    row["memcpy_us"] = percentile(mc, 50) / 1e3
                    row["memcpy_gbps"] = nbytes / (row["memcpy_us"] * 1e3)
                med = percentile(samples, 50)
                row[f"{name}_us"] = med / 1e3
                row[f"{name}_p99_us"] = percentile(samples, 99) / 1e3
                row[f"{name}_send_us"] = percentile(send_samples, 50) / 1e3
                row[f"{name}_gbps"] = nbytes / med
                row[f"{name}_x_memcpy"] = row[f"{name}_gbps"] / row["memcpy_gbps"]
                # The sender's writes and signals alone (no wake-up of the receiver).
                row[f"{name}_send_x_memcpy"] = row["memcpy_us"] / row[f"{name}_send_us"]
                row[f"{name}_samples_us"] = [s / 1e3 for s in samples]
                if contender is not None:  # into engine tensors, beside the shm pool's figure
                    row[f"{name}_over_shm"] = row[f"{name}_us"] / row[f"{pattern}_us"]
            if staged:
                samples = []
                for i in range(WARMUP + reps):
                    src = rng.sample(range(num_blocks), n)
                    dst = rng.sample(range(num_blocks), n)
                    tag += 1
                    if ask(conn, ("staged", tag, dst)) != "ready":
                        raise RuntimeError("the receiver did not take the staged hand-off")
                    t0 = time.perf_counter_ns()
                    stage.send(tag, gather(pool, src), PIPE_TIMEOUT_S)
                    stage.flush(PIPE_TIMEOUT_S)
                    if not conn.poll(PIPE_TIMEOUT_S):
                        raise TimeoutError("the staged hand-off did not complete")
                    t1 = conn.recv()
                    if i >= WARMUP:
                        samples.append(t1 - t0)
                med = percentile(samples, 50)
                row["staged_us"] = med / 1e3
                row["staged_x_memcpy"] = (nbytes / med) / row["memcpy_gbps"]
                row["staged_over_scattered"] = med / 1e3 / row["scattered_us"]
                row["staged_samples_us"] = [s / 1e3 for s in samples]
            rows.append(row)
            print(
                f"{kib:>6} KiB: memcpy {row['memcpy_us']:.1f} us, contiguous "
                f"{row['contiguous_us']:.1f} us ({row['contiguous_x_memcpy']:.2f}x), scattered "
                f"{row['scattered_us']:.1f} us ({row['scattered_x_memcpy']:.2f}x)",
                flush=True,
            )
        conn.send(None)
        child.join(PIPE_TIMEOUT_S)
        link.close()
        engine_link.close()
        stage.close()
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
        pool.close()
    return {"block_bytes": block_bytes, "rows": rows}


def goals(rows: list[dict]) -> dict:
    big = [r for r in rows if r["kib"] >= GOAL_MIN_KIB]
    names = [*PATTERNS, *(f"cma_{p}" for p in PATTERNS)]
    return {
        f"{p}_ge_{GOAL_RATIO}x_memcpy_from_{GOAL_MIN_KIB}_kib": bool(big)
        and all(r[f"{p}_x_memcpy"] >= GOAL_RATIO for r in big)
        for p in names
        if all(f"{p}_x_memcpy" in r for r in rows)
    }


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r["bytes"] for r in rows]
    ax.plot(x, [r["memcpy_gbps"] for r in rows], "k--o", label="memcpy (same bytes, one process)")
    for p in PATTERNS:
        ax.plot(x, [r[f"{p}_gbps"] for r in rows], "-o", label=f"KV hand-off, {p} blocks")
    for c, mark, what in (
        ("cma", "-^", "into engine tensors (CMA)"),
        ("shm_copy", "-.v", "shm + copy into engine tensors"),
    ):
        for p in PATTERNS:
            if all(f"{c}_{p}_gbps" in r for r in rows):
                ax.plot(x, [r[f"{c}_{p}_gbps"] for r in rows], mark, label=f"{what}, {p}")
    if all("staged_us" in r for r in rows):
        staged = [r["bytes"] / (r["staged_us"] * 1e3) for r in rows]
        ax.plot(x, staged, ":s", label="staged (gather, flat buffer, stage channel, scatter)")
    ax.set_yscale("log")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV bytes per hand-off")
    ax.set_ylabel("GB/s (bytes / median time)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 sizes, 4 repetitions (a smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench/results/kv_transfer.json")
    ap.add_argument("--plot", default="bench/results/kv_transfer.png")
    a = ap.parse_args(argv)
    sizes = QUICK_SIZES_KIB if a.quick else SIZES_KIB
    iters = QUICK_ITERS if a.quick else ITERS
    load_before = os.getloadavg()
    result = run(sizes, iters, a.seed)
    load_after = os.getloadavg()
    cols = [
        ("kib", "KiB", "d"),
        ("blocks", "blocks", "d"),
        ("memcpy_us", "memcpy us", ".1f"),
        ("contiguous_us", "contig us", ".1f"),
        ("contiguous_x_memcpy", "contig x memcpy", ".2f"),
        ("scattered_us", "scatter us", ".1f"),
        ("scattered_x_memcpy", "scatter x memcpy", ".2f"),
        ("contiguous_gbps", "contig GB/s", ".2f"),
        ("cma_contiguous_x_memcpy", "cma contig x memcpy", ".2f"),
        ("cma_scattered_x_memcpy", "cma scatter x memcpy", ".2f"),
        ("shm_copy_contiguous_x_memcpy", "shm+copy contig x memcpy", ".2f"),
        ("shm_copy_scattered_x_memcpy", "shm+copy scatter x memcpy", ".2f"),
        ("cma_scattered_over_shm", "cma/shm scatter", ".2f"),
        ("staged_us", "staged us", ".1f"),
        ("staged_over_scattered", "staged/scatter", ".2f"),
        ("contiguous_send_us", "contig send us", ".1f"),
        ("scattered_send_us", "scatter send us", ".1f"),
    ]
    print(format_table(result["rows"], cols))
    g = goals(result["rows"])
    print(f"goals: {g}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    payload = {
        "bench": "kv_transfer",
        "transport": "shm",
        "engine_tensors": "vLLM [2, num_blocks, ...] per layer; cma = process_vm_writev into them, "
        "shm_copy = into the shm pool, then one memmove per run and part into them",
        "quick": a.quick,
        "layout": {"layers": LAYERS, "parts": PARTS, "dtype": str(DTYPE)},
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "goals": g,
        **result,
    }
    write_json(a.json, payload)
    if a.plot:
        title = (
            f"KV hand-off over shm vs memcpy ({os.cpu_count()} CPUs, load "
            f"{load_before[0]:.1f}/{load_after[0]:.1f})"
        )
        plot(result["rows"], a.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
