"""KV hand-off over nixl across two "hosts" (network namespaces joined by a bridge, moecomm.netns),
beside NIXL's own WRITE of the same bytes between the same namespaces.

The receiver runs in host B (``KvPool`` over ``open_nixl_transport``), the sender in host A; each
is started with ``Lab.spawn`` (private /dev/shm, IPC and PID namespaces), so only the network
carries the KV. For each size and pattern the receiver reserves destination blocks
(``expect``) and hands the request over through a file (not timed); the sender times
``KvPeer.send``, which returns once the last layer's WRITE is complete at the target (the nixl
transport waits for the transfer that carries a layer's word) and the completion words went out.
Per layer the sender also reads the receiver's armed word (one small READ) before writing.

Contenders, in the same run and the same namespaces:

- ``kv contiguous``: source and destination blocks in one run: one descriptor per layer and part,
  all of a layer in one NIXL transfer carrying the layer's word;
- ``kv scattered``: random blocks: one descriptor per block, layer and part;
- ``nixl write``: NIXL's own WRITE of the same number of bytes as ONE descriptor from a registered
  buffer into the receiver's, waited for at the initiator (the floor: no words, no armed check,
  no per-run descriptors), on an agent made as moecomm makes its own.

Ratio = nixl write median / kv median (goal: ≥ 0.8 for ≥ 1 MiB). The receiver checks the last
transfer of each size against the sender's blocks (a checksum over the bytes), so a broken
contender cannot look fast. Load average before and after.

Usage: python bench/wire/kv_transfer_nixl.py [--quick] [--json PATH] [--plot PATH]
(needs root and NIXL: see moecomm.netns.available(), moecomm.wire.nixl.available())
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
from _lib.common import format_table, percentile, write_json

# The shm bench's KV shape and sizes (two layers, K and V, 4 KiB per part and block), so the two
# benches' rows compare; fewer repetitions here: each one crosses the veth.
from kv_transfer import (
    BIG_KIB,
    DTYPE,
    LAYERS,
    PARTS,
    QUICK_ITERS,
    QUICK_SIZES_KIB,
    SIZES_KIB,
    WARMUP,
)

ITERS = 12
BIG_ITERS = 5
GOAL_RATIO = 0.8
GOAL_MIN_KIB = 1024
PATTERNS = ("contiguous", "scattered")
# A file the other end writes is waited for this long (start-up of an agent included).
FILE_TIMEOUT_S = 120.0
FILE_POLL_S = 0.001
RUN_TIMEOUT_S = 900.0
NOTIF = b"k"


def layout(num_blocks: int):
    from moecomm.wire.kv import KvLayout

    return KvLayout.paged(LAYERS, num_blocks, DTYPE, PARTS)


def block_bytes() -> int:
    return layout(1).block_bytes


def put(tmp: str, name: str, value) -> None:
    path = os.path.join(tmp, name)
    with open(path + ".part", "w") as f:
        json.dump(value, f)
    os.rename(path + ".part", path)


def get(tmp: str, name: str):
    path = os.path.join(tmp, name)
    deadline = time.monotonic() + FILE_TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {name} within {FILE_TIMEOUT_S} s")
        time.sleep(FILE_POLL_S)
    with open(path) as f:
        return json.load(f)


def schedule(sizes_kib: list[int], iters: int, seed: int, num_blocks: int):
    """Every transfer both ends make, in order: (kib, pattern, index, src, dst)."""
    rng = random.Random(seed)
    out = []
    for kib in sizes_kib:
        n = kib * 1024 // block_bytes()
        reps = BIG_ITERS if kib >= BIG_KIB and iters > BIG_ITERS else iters
        for pattern in PATTERNS:
            for i in range(WARMUP + reps):
                if pattern == "contiguous":
                    src, dst = list(range(n)), list(range(n))
                else:
                    src = rng.sample(range(num_blocks), n)
                    dst = rng.sample(range(num_blocks), n)
                out.append((kib, pattern, i, src, dst))
    return out


def checksum(pool, blocks: list[int]) -> int:
    total = 0
    for p in pool.layout.parts:
        total += int(pool.view(p.layer, p.name)[blocks].view(torch.int16).sum())
    return total


def kv_receiver(a) -> None:
    from moecomm.wire.kv import KvPool
    from moecomm.wire.nixl import open_nixl_transport

    num_blocks = max(a.sizes) * 1024 // block_bytes()
    pool = KvPool(open_nixl_transport(host=a.self_addr), layout(num_blocks))
    for p in pool.layout.parts:  # touch every page once
        pool.view(p.layer, p.name).zero_()
    put(a.tmp, "receiver.info", pool.info().to_json())
    link = pool.connect(get(a.tmp, "sender.info"))
    plan = schedule(a.sizes, a.iters, a.seed, num_blocks)
    sums = {}
    for k, (kib, pattern, _, _, dst) in enumerate(plan):
        with link.expect(dst) as recv:
            put(a.tmp, f"req.{k}", recv.request.to_json())
            recv.wait(FILE_TIMEOUT_S)
            last = k + 1 == len(plan) or plan[k + 1][:2] != (kib, pattern)
            if last:
                sums[f"{kib}/{pattern}"] = checksum(pool, dst)
    put(a.tmp, "receiver.sums", sums)
    get(a.tmp, "sender.done")
    link.close()
    pool.close()


def kv_sender(a) -> None:
    from moecomm.wire.kv import KvPool
    from moecomm.wire.nixl import open_nixl_transport

    num_blocks = max(a.sizes) * 1024 // block_bytes()
    pool = KvPool(open_nixl_transport(host=a.self_addr), layout(num_blocks))
    g = torch.Generator().manual_seed(a.seed)
    for p in pool.layout.parts:
        v = pool.view(p.layer, p.name)
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    put(a.tmp, "sender.info", pool.info().to_json())
    link = pool.connect(get(a.tmp, "receiver.info"))
    plan = schedule(a.sizes, a.iters, a.seed, num_blocks)
    samples: dict[str, list[int]] = {}
    sums = {}
    for k, (kib, pattern, i, src, _) in enumerate(plan):
        request = get(a.tmp, f"req.{k}")
        t0 = time.perf_counter_ns()
        link.send(request, src)
        dt = time.perf_counter_ns() - t0
        if i >= WARMUP:
            samples.setdefault(f"{kib}/{pattern}", []).append(dt)
        sums[f"{kib}/{pattern}"] = checksum(pool, src)
    put(a.tmp, "sender.samples", {"samples_ns": samples, "sums": sums})
    put(a.tmp, "sender.done", 1)
    link.close()
    pool.close()


def nixl_agent(a):
    from moecomm.wire.nixl import new_agent

    agent, _ = new_agent(host=a.self_addr)
    return agent


def nixl_buffer(agent, nbytes: int) -> torch.Tensor:
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], "DRAM")
    return buf


def nixl_swap(a, agent, me: str, other: str, buf) -> tuple[str, int]:
    """Swaps agent metadata and a buffer's address with the other end (files under a.tmp)."""
    import base64

    blob = base64.b64encode(agent.get_agent_metadata()).decode()
    put(a.tmp, f"{me}.agent", {"md": blob, "addr": buf.data_ptr()})
    got = get(a.tmp, f"{other}.agent")
    name = agent.add_remote_agent(base64.b64decode(got["md"]))
    return (name.decode() if isinstance(name, bytes) else name), got["addr"]


def nixl_receiver(a) -> None:
    agent = nixl_agent(a)
    buf = nixl_buffer(agent, max(a.sizes) * 1024)
    nixl_swap(a, agent, "receiver", "sender", buf)
    sums = get(a.tmp, "sender.sums")
    # The sender wrote its pattern for each size last at the buffer's start: check the largest.
    got = int(buf.view(torch.int16).sum())
    put(a.tmp, "receiver.sums", {"check": got, "want": sums["last"]})
    get(a.tmp, "sender.done")


def nixl_sender(a) -> None:
    agent = nixl_agent(a)
    src = nixl_buffer(agent, max(a.sizes) * 1024)
    src.copy_(torch.randint(0, 255, src.shape, dtype=torch.uint8, generator=None))
    peer, remote = nixl_swap(a, agent, "sender", "receiver", src)
    samples: dict[str, list[int]] = {}
    for kib in a.sizes:
        nbytes = kib * 1024
        reps = BIG_ITERS if kib >= BIG_KIB and a.iters > BIG_ITERS else a.iters
        lo = agent.get_xfer_descs([(src.data_ptr(), nbytes, 0)], "DRAM")
        ro = agent.get_xfer_descs([(remote, nbytes, 0)], "DRAM")
        h = agent.initialize_xfer("WRITE", lo, ro, peer)
        for i in range(WARMUP + reps):
            t0 = time.perf_counter_ns()
            state = agent.transfer(h, NOTIF)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            dt = time.perf_counter_ns() - t0
            if state != "DONE":
                raise RuntimeError(f"a NIXL WRITE ended {state}")
            if i >= WARMUP:
                samples.setdefault(f"{kib}/write", []).append(dt)
        agent.release_xfer_handle(h)
    put(a.tmp, "sender.samples", {"samples_ns": samples})
    put(a.tmp, "sender.sums", {"last": int(src.view(torch.int16).sum())})
    get(a.tmp, "receiver.sums")
    put(a.tmp, "sender.done", 1)


ROLES = {
    "kv-receiver": kv_receiver,
    "kv-sender": kv_sender,
    "nixl-receiver": nixl_receiver,
    "nixl-sender": nixl_sender,
}


def run_pair(lab, a_host, b_host, kind: str, sizes: list[int], iters: int, seed: int) -> dict:
    """Receiver of `kind` in host B, sender in host A; returns the sender's samples and both
    ends' checksums."""
    me = [sys.executable, os.path.abspath(__file__), "--role"]
    common = ["--sizes", ",".join(map(str, sizes)), "--iters", str(iters), "--seed", str(seed)]
    with (
        tempfile.TemporaryDirectory(prefix="moecomm-kvnixl-") as tmp,
        ExitStack() as files,
    ):
        logs = {
            k: files.enter_context(open(os.path.join(tmp, f"{k}.log"), "w+"))
            for k in ("receiver", "sender")
        }
        procs = {}
        try:
            for role, host in (("receiver", b_host), ("sender", a_host)):
                procs[role] = lab.spawn(
                    host,
                    [*me, f"{kind}-{role}", "--tmp", tmp, "--self-addr", host.addr, *common],
                    stdout=logs[role],
                    stderr=subprocess.STDOUT,
                )
            rcs = {k: p.wait(RUN_TIMEOUT_S) for k, p in procs.items()}
        except subprocess.TimeoutExpired:
            rcs = {"timeout": True}
        finally:
            for p in procs.values():
                lab.kill(p)
        if any(rcs.values()):
            text = {}
            for k, f in logs.items():
                f.seek(0)
                text[k] = f.read()[-4000:]
            raise RuntimeError(f"{kind}: {rcs}\n{text}")
        out = get(tmp, "sender.samples")
        out["receiver_sums"] = get(tmp, "receiver.sums")
    return out


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r["bytes"] for r in rows]
    ax.plot(x, [r["nixl_write_gbps"] for r in rows], "k--o", label="NIXL's own WRITE (1 desc)")
    for p in PATTERNS:
        ax.plot(x, [r[f"{p}_gbps"] for r in rows], "-o", label=f"KV hand-off over nixl, {p}")
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
    ap.add_argument("--role", choices=sorted(ROLES))
    ap.add_argument("--tmp")
    ap.add_argument("--self-addr")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--iters", type=int)
    ap.add_argument("--quick", action="store_true", help="3 sizes, 4 repetitions (a smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench/results/kv_transfer_nixl.json")
    ap.add_argument("--plot", default="bench/results/kv_transfer_nixl.png")
    a = ap.parse_args(argv)
    if a.role:
        ROLES[a.role](a)
        return 0
    from moecomm.netns import Lab, available
    from moecomm.wire.nixl import available as nixl_available

    for what, (ok, why) in (("netns", available()), ("nixl", nixl_available())):
        if not ok:
            print(f"cannot run: {what}: {why}", file=sys.stderr)
            return 2
    sizes = QUICK_SIZES_KIB if a.quick else SIZES_KIB
    iters = QUICK_ITERS if a.quick else ITERS
    load_before = os.getloadavg()
    with Lab() as lab:
        ha, hb = lab.add_host("a"), lab.add_host("b")
        kv = run_pair(lab, ha, hb, "kv", sizes, iters, a.seed)
        own = run_pair(lab, ha, hb, "nixl", sizes, iters, a.seed)
    load_after = os.getloadavg()
    checks = {
        "kv": kv["receiver_sums"] == kv["sums"],
        "nixl": own["receiver_sums"]["check"] == own["receiver_sums"]["want"],
    }
    rows = []
    for kib in sizes:
        nbytes = kib * 1024
        row = {"kib": kib, "bytes": nbytes, "blocks": nbytes // block_bytes()}
        w = own["samples_ns"][f"{kib}/write"]
        row["nixl_write_us"] = percentile(w, 50) / 1e3
        row["nixl_write_gbps"] = nbytes / percentile(w, 50)
        for p in PATTERNS:
            s = kv["samples_ns"][f"{kib}/{p}"]
            med = percentile(s, 50)
            row[f"{p}_us"] = med / 1e3
            row[f"{p}_p99_us"] = percentile(s, 99) / 1e3
            row[f"{p}_gbps"] = nbytes / med
            row[f"{p}_x_nixl"] = percentile(w, 50) / med
            row[f"{p}_samples_us"] = [x / 1e3 for x in s]
        rows.append(row)
    big = [r for r in rows if r["kib"] >= GOAL_MIN_KIB]
    goals = {
        f"{p}_ge_{GOAL_RATIO}x_nixl_write_from_{GOAL_MIN_KIB}_kib": bool(big)
        and all(r[f"{p}_x_nixl"] >= GOAL_RATIO for r in big)
        for p in PATTERNS
    }
    cols = [
        ("kib", "KiB", "d"),
        ("nixl_write_us", "NIXL write us", ".1f"),
        ("contiguous_us", "kv contig us", ".1f"),
        ("contiguous_x_nixl", "contig x NIXL", ".2f"),
        ("scattered_us", "kv scatter us", ".1f"),
        ("scattered_x_nixl", "scatter x NIXL", ".2f"),
        ("nixl_write_gbps", "NIXL GB/s", ".3f"),
        ("contiguous_gbps", "contig GB/s", ".3f"),
    ]
    print(format_table(rows, cols))
    print(f"checks {checks}; goals {goals}; load {load_before[0]:.2f} before, {load_after[0]:.2f}")
    write_json(
        a.json,
        {
            "bench": "kv_transfer_nixl",
            "transport": "nixl across two network namespaces (moecomm.netns)",
            "quick": a.quick,
            "layout": {"layers": LAYERS, "parts": PARTS, "dtype": str(DTYPE)},
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "checks": checks,
            "goals": goals,
            "block_bytes": block_bytes(),
            "rows": rows,
        },
    )
    if a.plot:
        title = (
            f"KV hand-off over nixl across namespaces vs NIXL's WRITE ({os.cpu_count()} CPUs, "
            f"load {load_before[0]:.1f}/{load_after[0]:.1f})"
        )
        plot(rows, a.plot, title)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
