"""Live expert re-placement: a static placement against the placement controller, same load.

    python bench/recovery/replacement.py [--quick] [--reps N] [--json PATH] [--png PATH]

Three expert-server processes host 16 experts of 2 layers (6 each: 18 slots, 2 replicas) read
from a safetensors checkpoint the bench writes; one attention client here dispatches a skewed
load (three hot experts take most tokens) whose hot set moves half way through. Contenders, one
after the other on fresh servers with the same seeds and load trace, --reps times each in ABBA
order (medians pool the windows of every run):

- static: the placement the servers started with;
- eplb-per-expert: PlacementController(batched=False) every --interval seconds — the old path:
  one request, one rebuild of the layer and one epoch per expert loaded or dropped;
- eplb: PlacementController every --interval seconds, as `moecomm frontend --eplb-interval`
  runs it: per server, one request loading all its new experts (one rebuild per layer, one
  epoch), then one marking all its leaving ones (one epoch).

Per 1-s window: per-server imbalance (max / mean routed (token, k) pairs over the servers) and
throughput (routed tokens per second). The tables give medians per phase and the eplb/static
ratios; per pass: moves, replicas and bytes moved, apply (loads + publish + marking the drops)
and converge (until the dropped copies are freed); throughput during a move: the windows that
overlap a pass's [start, start + converge], against the static runs' windows at the same times.
A last part times expert loads from the checkpoint against pulls from a peer server over the
transport, one per request and in one batch of BATCH_LOADS (medians of --loads each).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import httpx
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts

from _lib.common import format_table, write_json
from moecomm.runtime.control import HttpServer, make_app
from moecomm.runtime.experts import ExpertWeights, random_experts
from moecomm.runtime.launch import start_server_process, wait_for_stop
from moecomm.runtime.placement import PlacementController
from moecomm.runtime.server import ExpertServer
from moecomm.testing.clients import connect_client

LAYERS, EXPERTS, HIDDEN, INTER, TOPK = 2, 16, 1024, 512, 2
# 6 experts per server, the windows overlapping so experts 0 and 8 start with two replicas.
HOSTED = [list(range(0, 6)), list(range(5, 11)), [*range(10, 16), 0][:6]]
HOT_WEIGHT = 12.0  # a hot expert draws 12x the tokens of a cold one
WINDOW_S = 1.0
TOKEN = "bench"
# Experts per timed batch load (the last part): as many as a pass typically loads on a server.
BATCH_LOADS = 5
CONTENDERS = ("static", "eplb-per-expert", "eplb")


def write_checkpoint(path: str) -> str:
    experts = random_experts(LAYERS, EXPERTS, HIDDEN, INTER, seed=7)
    tensors = {}
    for layer, es in experts.items():
        for e, w in es.items():
            for name in ("w1", "w3", "w2"):
                tensors[f"l{layer}.e{e}.{name}"] = getattr(w, name).contiguous()
    file = os.path.join(path, "experts.safetensors")
    save_file(tensors, file)
    return file


def read_expert(file: str, layer: int, e: int) -> ExpertWeights:
    """One expert from the checkpoint file (safetensors reads only the tensors asked for)."""
    with safe_open(file, framework="pt") as f:
        return ExpertWeights(*(f.get_tensor(f"l{layer}.e{e}.{n}") for n in ("w1", "w3", "w2")))


def _serve(conn, file: str, ids: list[int], server_id: str) -> None:
    torch.set_num_threads(1)
    experts = {la: {e: read_expert(file, la, e) for e in ids} for la in range(LAYERS)}
    server = ExpertServer(experts, server_id, weight_source=lambda la, e: read_expert(file, la, e))
    http = HttpServer(make_app(server, TOKEN))
    server.start()
    conn.send(http.start())
    wait_for_stop(conn, server)
    http.stop()
    server.close()


def start_servers(file: str) -> list:
    return [
        start_server_process(_serve, (file, ids, f"s{i}"), f"s{i}") for i, ids in enumerate(HOSTED)
    ]


def hot_set(phase: int) -> list[int]:
    # Phase 0 heats experts served by one server mostly; phase 1 those of another.
    return [1, 2, 3] if phase == 0 else [11, 12, 13]


def run_trace(urls, duration, interval, seed, name):
    client = connect_client(urls, HIDDEN, TOPK, 64, encoding="bf16", token=TOKEN)
    controller = None
    if name != "static":
        controller = PlacementController(
            urls, TOKEN, min_tokens=512, windows=2, batched=name == "eplb"
        )
        controller.start(interval)
    g = torch.Generator().manual_seed(seed)
    windows, lost, start = [], 0, time.monotonic()
    cur = {"t": 0.0, "pairs": [0] * len(urls), "tokens": 0, "steps": 0}
    step = 0
    try:
        while (now := time.monotonic() - start) < duration:
            if now - cur["t"] >= WINDOW_S:
                windows.append(cur)
                cur = {"t": now, "pairs": [0] * len(urls), "tokens": 0, "steps": 0}
            phase = int(now >= duration / 2)
            hot = hot_set(phase)
            p = torch.tensor([HOT_WEIGHT if e in hot else 1.0 for e in range(EXPERTS)])
            n = int(torch.randint(32, 65, (1,), generator=g))
            ids = torch.stack([torch.multinomial(p, TOPK, generator=g) for _ in range(n)]).int()
            x = torch.randn(n, HIDDEN, generator=g)
            w = torch.rand(n, TOPK, generator=g)
            try:
                h = client.dispatch(x, ids, w, step % LAYERS)
                for s in h.sent:
                    cur["pairs"][s.server] += int(s.pairs.sum())
                client.combine(h)
                cur["tokens"] += n
                cur["steps"] += 1
            except Exception as exc:  # a lost request: reported, never expected
                lost += 1
                print(f"lost: {exc}")
            step += 1
    finally:
        if controller is not None:
            controller.stop()
        client.close()
    rows = []
    for wdw in windows[1:]:  # the first window is warm-up
        pairs = wdw["pairs"]
        mean = sum(pairs) / len(pairs)
        rows.append(
            {
                "t": wdw["t"],
                "imbalance": max(pairs) / mean if mean else 1.0,
                "tokens_per_s": wdw["tokens"] / WINDOW_S,
                "pairs": pairs,
            }
        )
    reports = [r.to_dict() for r in controller.reports] if controller else []
    return rows, reports, lost, client.failovers


def phase_stats(runs, lo, hi):
    """Medians over the windows of every run of a contender that fall in [lo, hi)."""
    sel = [r for rows in runs for r in rows if lo <= r["t"] < hi]
    if not sel:
        return {"imbalance": None, "tokens_per_s": None}
    return {
        "imbalance": statistics.median(r["imbalance"] for r in sel),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in sel),
    }


def time_loads(urls, reps):
    """Loads, on the first server, layer-0 experts it lacks that other servers host: one from
    the checkpoint and pulled from a peer hosting it (a request each), then BATCH_LOADS in one batch
    request from each source, dropping them in between. Seconds per expert."""
    tables = [httpx.get(f"{u}/experts", timeout=10).json()["layers"]["0"] for u in urls]
    target = urls[0]
    # The trace before this moved experts: take each lacking expert from any server hosting it.
    peer_of = {}
    for u, table in zip(urls[1:], tables[1:], strict=True):
        for e in range(EXPERTS):
            if e not in tables[0] and e in table:
                peer_of.setdefault(e, u)
    lacking = sorted(peer_of)
    if len(lacking) < BATCH_LOADS:
        raise RuntimeError(f"the first server lacks only {lacking} of the others' experts")
    peer = peer_of[lacking[0]]
    out = {"checkpoint": [], "peer": [], "batch checkpoint": [], "batch peer": []}
    for _ in range(reps):
        for source in ("checkpoint", "peer"):
            body = {"layer": 0, "expert": lacking[0], "token": TOKEN}
            r = httpx.post(
                f"{target}/experts/load", json={**body, "source": source, "peer": peer}, timeout=60
            )
            if r.status_code != 200:
                raise RuntimeError(f"load from {source} failed: {r.text}")
            out[source].append(r.json()["seconds"])
            drop_and_wait(target, [lacking[0]])
            batch = [
                {"layer": 0, "expert": e, "source": source, "peer": peer_of[e]}
                for e in lacking[:BATCH_LOADS]
            ]
            r = httpx.post(
                f"{target}/experts/load_batch",
                json={"experts": batch, "token": TOKEN},
                timeout=60,
            )
            if r.status_code != 200:
                raise RuntimeError(f"batch load from {source} failed: {r.text}")
            out[f"batch {source}"].append(r.json()["seconds"] / BATCH_LOADS)
            drop_and_wait(target, lacking[:BATCH_LOADS])
    return out


def drop_and_wait(url: str, experts: list[int]) -> None:
    body = {"experts": [{"layer": 0, "expert": e} for e in experts], "token": TOKEN}
    httpx.post(f"{url}/experts/unload_batch", json=body, timeout=60).raise_for_status()
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/experts", timeout=10).json()["leaving"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the unloaded experts were never dropped")
        time.sleep(0.02)


def during_moves(result, traces) -> dict:
    """Throughput in the windows that overlap a pass's [start, start + converge], against the
    static runs' windows starting at the same times (medians)."""
    static_at: dict[float, list[float]] = {}
    for rows in traces["static"]:
        for r in rows:
            static_at.setdefault(round(r["t"]), []).append(r["tokens_per_s"])
    out = {}
    for name in CONTENDERS[1:]:
        moving, reference = [], []
        for run in result.get(name, []):
            spans = [
                (p["t_rel"], p["t_rel"] + p["converge_seconds"])
                for p in run["passes"]
                if p["moves"]
            ]
            for w in run["windows"]:
                if any(w["t"] < hi and w["t"] + WINDOW_S > lo for lo, hi in spans):
                    moving.append(w["tokens_per_s"])
                    reference += static_at.get(round(w["t"]), [])
        if moving and reference:
            out[name] = {
                "windows": len(moving),
                "tps_during_moves": statistics.median(moving),
                "tps_static_same_times": statistics.median(reference),
                "ratio": statistics.median(moving) / statistics.median(reference),
            }
    return out


def plot(path, traces, duration, reports):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    for name, rows in traces.items():
        t = [r["t"] for r in rows]
        a1.plot(t, [r["imbalance"] for r in rows], label=name, drawstyle="steps-post")
        a2.plot(t, [r["tokens_per_s"] for r in rows], label=name, drawstyle="steps-post")
    for ax in (a1, a2):
        ax.axvline(duration / 2, color="gray", linestyle=":")
    moved = [r for r in reports if r["moves"]]
    for r in moved:
        a1.axvline(r["t_rel"], color="red", linestyle="--", linewidth=0.8)
    a1.set_ylabel("imbalance (max/mean)")
    a1.set_title("live re-placement (red: eplb passes that moved replicas; dotted: load drift)")
    a1.legend()
    a2.set_ylabel("tokens/s")
    a2.set_xlabel("time (s)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=40.0, help="seconds per contender")
    ap.add_argument("--interval", type=float, default=3.0, help="eplb pass interval (s)")
    ap.add_argument("--loads", type=int, default=5, help="timed loads per weight source")
    ap.add_argument("--reps", type=int, default=2, help="runs per contender, order rotated")
    ap.add_argument("--quick", action="store_true", help="smoke run (12 s per contender, once)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    a = ap.parse_args()
    if a.quick:
        a.duration, a.interval, a.loads, a.reps = 12.0, 2.0, 2, 1
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    traces, summary, result = {}, [], {}
    with tempfile.TemporaryDirectory() as tmp:
        file = write_checkpoint(tmp)
        # The order turns around every run: a machine that gets busier or quieter during the
        # run favours no contender.
        order = [n for i in range(a.reps) for n in (CONTENDERS if i % 2 == 0 else CONTENDERS[::-1])]
        for name in order:
            servers = start_servers(file)
            try:
                urls = [s.url for s in servers]
                began = time.time()
                rows, reports, lost, failovers = run_trace(urls, a.duration, a.interval, 0, name)
                for r in reports:
                    r["t_rel"] = r["started"] - began
                traces.setdefault(name, []).append(rows)
                result.setdefault(name, []).append(
                    {"windows": rows, "passes": reports, "lost": lost, "failovers": failovers}
                )
                if name == "eplb" and "loads" not in result:
                    result["loads"] = time_loads(urls, a.loads)
            finally:
                for s in servers:
                    s.stop()
    half = a.duration / 2
    # "settled": the second half of each phase, after the controller had time to react.
    phases = {
        "phase 1 start": (0, half / 2),
        "phase 1 settled": (half / 2, half),
        "phase 2 start": (half, half * 1.5),
        "phase 2 settled": (half * 1.5, a.duration),
    }
    for label, (lo, hi) in phases.items():
        row = {"phase": label}
        st = phase_stats(traces["static"], lo, hi)
        row["imb_static"], row["tps_static"] = st["imbalance"], st["tokens_per_s"]
        for name, key in (("eplb-per-expert", "old"), ("eplb", "eplb")):
            got = phase_stats(traces[name], lo, hi)
            row[f"imb_{key}"], row[f"tps_{key}"] = got["imbalance"], got["tokens_per_s"]
            if st["tokens_per_s"] and got["tokens_per_s"]:
                row[f"ratio_{key}"] = got["tokens_per_s"] / st["tokens_per_s"]
        summary.append(row)
    print(
        format_table(
            summary,
            [
                ("phase", "phase", ""),
                ("imb_static", "imbalance static", ".3f"),
                ("imb_old", "per-expert", ".3f"),
                ("imb_eplb", "eplb", ".3f"),
                ("tps_static", "tok/s static", ".0f"),
                ("tps_old", "per-expert", ".0f"),
                ("tps_eplb", "eplb", ".0f"),
                ("ratio_old", "per-expert/static", ".2f"),
                ("ratio_eplb", "eplb/static", ".2f"),
            ],
        )
    )
    moves = [
        {
            "contender": name,
            "t_s": r["t_rel"],
            "moves": len(r["moves"]),
            "loaded": r["replicas_loaded"],
            "dropped": r["replicas_dropped"],
            "requests": r["load_batches"],
            "mb": r["bytes_moved"] / 1e6,
            "imb_before": r["imbalance_before"],
            "imb_after": r["imbalance_after"],
            "apply_s": r["apply_seconds"],
            "converge_s": r["converge_seconds"],
        }
        for name in CONTENDERS[1:]
        for run in result[name]
        for r in run["passes"]
        if r["moves"]
    ]
    print()
    print(
        format_table(
            moves,
            [
                ("contender", "contender", ""),
                ("t_s", "t (s)", ".1f"),
                ("moves", "moves", "d"),
                ("loaded", "loaded", "d"),
                ("dropped", "dropped", "d"),
                ("requests", "load requests", "d"),
                ("mb", "MB moved", ".1f"),
                ("imb_before", "planned imb before", ".3f"),
                ("imb_after", "after", ".3f"),
                ("apply_s", "apply (s)", ".2f"),
                ("converge_s", "converge (s)", ".2f"),
            ],
        )
    )
    converge = {}
    for name in CONTENDERS[1:]:
        got = [m["converge_s"] for m in moves if m["contender"] == name]
        if got:
            converge[name] = {
                "passes": len(got),
                "median_s": statistics.median(got),
                "max_s": max(got),
                "apply_median_s": statistics.median(
                    m["apply_s"] for m in moves if m["contender"] == name
                ),
            }
    during = during_moves(result, traces)
    print()
    for name in CONTENDERS[1:]:
        c, d = converge.get(name), during.get(name)
        if c:
            print(
                f"{name}: converge median {c['median_s']:.2f} s, max {c['max_s']:.2f} s over "
                f"{c['passes']} passes (apply median {c['apply_median_s']:.2f} s)"
            )
        if d:
            print(
                f"{name}: throughput during moves {d['tps_during_moves']:.0f} tok/s vs static "
                f"{d['tps_static_same_times']:.0f} at the same times: {d['ratio']:.2f}x "
                f"({d['windows']} windows)"
            )
    loads = {
        src: {"median_ms_per_expert": statistics.median(v) * 1e3, "samples": len(v)}
        for src, v in result["loads"].items()
    }
    print(
        "\nexpert loads, ms per expert (medians of "
        f"{a.loads}): "
        + ", ".join(f"{src} {v['median_ms_per_expert']:.1f}" for src, v in loads.items())
    )
    lost = {k: sum(run["lost"] for run in result[k]) for k in CONTENDERS}
    resends = {k: sum(run["failovers"] for run in result[k]) for k in CONTENDERS[1:]}
    print(f"requests lost: {lost} ({a.reps} runs each); stale-map re-sends (failovers) {resends}")
    load_after = os.getloadavg()
    print(f"load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    if a.png:
        first = {k: v[0] for k, v in traces.items()}
        plot(a.png, first, a.duration, result["eplb"][0]["passes"])
    write_json(
        a.json,
        {
            "config": vars(a),
            "command": " ".join(sys.argv),
            "loadavg_before_after": [load_before[0], load_after[0]],
            "summary": summary,
            "converge": converge,
            "during_moves": during,
            "moves": moves,
            "load_sources": loads,
            "lost": lost,
            "runs": result,
        },
    )
    return 0 if not any(lost.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
