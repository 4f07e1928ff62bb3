"""The soak's verdict, tables, JSON and plot (bench/soak/soak.py runs it; this only reads results).

RSS drift of a process: its VmRSS samples after the warm-up (the first `warmup_frac` of the run)
are split into a first and a last window (RSS_WINDOW_FRAC of them each); drift = (median of the
last window - median of the first) / median of the first. Medians, so one sample taken while an
allocator briefly holds a freed buffer does not decide; a leak moves the whole window.
"""

from __future__ import annotations

import math
import os
import statistics

from .common import format_table, percentile, write_json

# Share of the post-warm-up RSS samples in each of the two windows that drift compares.
RSS_WINDOW_FRAC = 0.1
# Fewer post-warm-up samples than this and a drift figure means nothing: the run fails.
MIN_RSS_SAMPLES = 4
KB_PER_MB = 1024.0
# A server's /health counters that must still be 0 after a fault-free run.
SERVER_COUNTERS = ("batch_failures", "rejected", "dead_clients_dropped")


def _drift(samples: list, warm_s: float, end_s: float) -> dict:
    post = [kb for t, kb in samples if warm_s <= t <= end_s]
    out = {"samples": len(post), "base_mb": None, "end_mb": None, "peak_mb": None, "drift": None}
    if len(post) < MIN_RSS_SAMPLES:
        return out
    k = max(1, math.ceil(len(post) * RSS_WINDOW_FRAC))
    base, end = statistics.median(post[:k]), statistics.median(post[-k:])
    out.update(
        base_mb=base / KB_PER_MB,
        end_mb=end / KB_PER_MB,
        peak_mb=max(post) / KB_PER_MB,
        drift=(end - base) / base,
        peak_growth=(max(post) - base) / base,
    )
    return out


def rss_processes(pids: dict[str, int], samples: dict, warm_s: float, end_s: float) -> list:
    """One row per process (role -> pid): its drift between warm_s and end_s (see above)."""
    return [
        {"process": role, "pid": pid, **_drift(samples.get(role, []), warm_s, end_s)}
        for role, pid in pids.items()
    ]


def rss_failures(procs: list[dict], limit: float) -> list[str]:
    """A process with too few samples to judge, or whose |drift| exceeds `limit`."""
    out = []
    for p in procs:
        if p["drift"] is None:
            out.append(f"{p['process']}: {p['samples']} RSS samples after warm-up")
        elif abs(p["drift"]) > limit:
            out.append(
                f"{p['process']}: RSS drift {p['drift']:+.1%} > {limit:.0%} "
                f"({p['base_mb']:.1f} -> {p['end_mb']:.1f} MB)"
            )
    return out


def max_abs_drift(procs: list[dict]) -> float | None:
    return max((abs(p["drift"]) for p in procs if p["drift"] is not None), default=None)


def _rss_at(samples: dict, t_end: float, prefix: str) -> float | None:
    """Sum over the processes whose role starts with `prefix` of their last sample <= t_end."""
    total, any_ = 0, False
    for role, ss in samples.items():
        if role.startswith(prefix):
            before = [kb for t, kb in ss if t <= t_end]
            if before:
                total, any_ = total + before[-1], True
    return total / KB_PER_MB if any_ else None


def analyse(run, cfg: dict, placement, duration: float, wall: float, health, leaked) -> dict:
    """Everything the report, JSON and plot show, and the list of failures (empty = pass)."""
    interval = cfg["interval_s"]
    rows, all_lat = [], []
    totals = dict.fromkeys(
        (
            "round_trips",
            "requests",
            "empty",
            "checked",
            "wrong",
            "errors",
            "failovers",
            "reconnects",
        ),
        0,
    )
    for b in sorted(run.buckets):
        k = run.buckets[b]
        lat = k["lat_ns"]
        all_lat += lat
        t_end = min((b + 1) * interval, duration)
        rows.append(
            {
                "interval": b,
                "t_start_s": b * interval,
                "t_end_s": t_end,
                "round_trips": k["rt"],
                "requests": k["requests"],
                "empty": k["empty"],
                "p50_us": percentile(lat, 50) / 1e3 if lat else None,
                "p99_us": percentile(lat, 99) / 1e3 if lat else None,
                "max_us": max(lat) / 1e3 if lat else None,
                "checked": k["checked"],
                "wrong": k["wrong"],
                "errors": k["errors"],
                "failovers": k["failovers"],
                "client_mb": _rss_at(run.rss, t_end, "c"),
                "server_mb": _rss_at(run.rss, t_end, "s"),
            }
        )
        for key, src in (("round_trips", "rt"), *((x, x) for x in list(totals)[1:])):
            totals[key] += k[src]
    steady = duration if run.steady_end_s is None else run.steady_end_s
    warm = cfg["warmup_frac"] * steady
    procs = rss_processes(run.procs, run.rss, warm, steady)
    failures = list(run.failures)
    if run.hang:
        failures.append(f"hang: {run.hang}")
    for key in ("errors", "wrong", "failovers", "reconnects"):
        if totals[key]:
            failures.append(f"{totals[key]} {key}")
    if cfg["duration_s"] is None and totals["round_trips"] < cfg["round_trips"] and not failures:
        failures.append(f"only {totals['round_trips']} of {cfg['round_trips']} round trips")
    if not totals["checked"]:
        failures.append("no result was checked")
    failures += rss_failures(procs, cfg["drift_limit"])
    for s, h in health.items():
        bad = {k: h.get(k) for k in SERVER_COUNTERS if h.get(k)}
        if h["status"] != 200 or bad:
            failures.append(f"server {s}: /health at the end: {h}")
    if leaked:
        failures.append(f"shared-memory segments left behind: {leaked}")
    return {
        "config": cfg,
        "placement": placement,
        "duration_s": duration,
        "wall_s": wall,
        "totals": totals,
        "round_trips_per_s": totals["round_trips"] / duration if duration else None,
        "latency_us": {
            "p50": percentile(all_lat, 50) / 1e3 if all_lat else None,
            "p99": percentile(all_lat, 99) / 1e3 if all_lat else None,
            "max": max(all_lat) / 1e3 if all_lat else None,
        },
        "intervals": rows,
        "warmup_end_s": warm,
        "steady_end_s": steady,
        "rss": {"processes": procs, "samples": run.rss},
        "max_abs_drift": max_abs_drift(procs),
        "health": health,
        "leaked_segments": leaked,
        "error_samples": run.errors,
        "wrong_samples": run.wrong,
        "hang": run.hang,
        "failures": failures,
        "ok": not failures,
    }


def print_rss(r: dict, end_what: str) -> None:
    """The per-process RSS table of a result with "rss", "warmup_end_s" and "steady_end_s"."""
    if not r["rss"]["processes"]:
        print("\nno RSS sample")
        return
    print(
        f"\nRSS from the end of the warm-up ({r['warmup_end_s']:.1f} s) until {end_what} "
        f"({r['steady_end_s']:.1f} s); drift = last vs first window:"
    )
    print(
        format_table(
            r["rss"]["processes"],
            [
                ("process", "process", ""),
                ("pid", "pid", "d"),
                ("samples", "samples", "d"),
                ("base_mb", "first MB", ".1f"),
                ("end_mb", "last MB", ".1f"),
                ("peak_mb", "peak MB", ".1f"),
                ("drift", "drift", "+.2%"),
            ],
        )
    )


def print_report(r: dict) -> None:
    c = r["config"]
    print(
        f"\nsoak: {c['clients']} clients x 2 micro-batches, {c['servers']} expert servers, every "
        f"expert on {c['replicas']}; batches 0..{c['max_tokens']} tokens, top-{c['topk']}, "
        f"H={c['hidden']} I={c['intermediate']} E={c['num_experts']} L={c['num_layers']}, f32, "
        f"seed {c['seed']}, combine order {c['order']}"
        + (", released slots poisoned" if c["poison_slots"] else "")
    )
    print(f"per {c['interval_s']:g} s (latency = dispatch -> combine, non-empty batches):")
    print(
        format_table(
            r["intervals"],
            [
                ("interval", "#", "d"),
                ("t_end_s", "t s", ".0f"),
                ("round_trips", "round trips", "d"),
                ("requests", "requests", "d"),
                ("p50_us", "p50 µs", ".0f"),
                ("p99_us", "p99 µs", ".0f"),
                ("max_us", "max µs", ".0f"),
                ("checked", "checked", "d"),
                ("wrong", "#wrong", "d"),
                ("errors", "#err", "d"),
                ("failovers", "failovers", "d"),
                ("client_mb", "clients MB", ".1f"),
                ("server_mb", "servers MB", ".1f"),
            ],
        )
    )
    print_rss(r, "the first client ended")
    t, lat = r["totals"], r["latency_us"]
    rate = r["round_trips_per_s"] or 0.0
    print(
        f"\n{t['round_trips']} round trips ({t['empty']} empty, {t['requests']} server requests) "
        f"in {r['duration_s']:.1f} s ({rate:.0f}/s; {r['wall_s']:.1f} s with start and stop); "
        f"p50 {lat['p50'] or math.nan:.0f} µs, p99 {lat['p99'] or math.nan:.0f} µs, "
        f"max {lat['max'] or math.nan:.0f} µs; checked {t['checked']}, wrong {t['wrong']}, "
        f"errors {t['errors']}, failovers {t['failovers']}, reconnects {t['reconnects']}; "
        f"max |RSS drift| "
        f"{r['max_abs_drift'] if r['max_abs_drift'] is not None else math.nan:.2%}"
    )
    for e in r["error_samples"]:
        print(f"  error: {e}")
    for w in r["wrong_samples"]:
        print(f"  wrong: {w}")
    if r["ok"]:
        print("PASS")
    else:
        print("FAIL:\n  " + "\n  ".join(r["failures"]))


def write_report(path: str | None, r: dict) -> None:
    write_json(path, {"soak": r})


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [x for x in r["intervals"] if x["p50_us"] is not None]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    mid = [(x["t_start_s"] + x["t_end_s"]) / 2 for x in rows]
    ax1.plot(mid, [x["p50_us"] / 1e3 for x in rows], "o-", label="p50")
    ax1.plot(mid, [x["p99_us"] / 1e3 for x in rows], "s-", label="p99")
    ax1.set_ylabel("round trip (ms)")
    ax1.set_ylim(bottom=0)
    ax1.legend(loc="upper left")
    c = r["config"]
    ax1.set_title(
        f"soak: {c['clients']} clients, {c['servers']} servers x{c['replicas']} replicas, "
        f"{r['totals']['round_trips']} round trips, per {c['interval_s']:g} s"
    )
    plot_rss(ax2, r, (ax1, ax2))
    save_figure(fig, path)


def plot_rss(ax, r: dict, shaded: tuple) -> None:
    """RSS of every process over time on `ax`; the warm-up and the wind-down (not in the
    drift) greyed on every axis in `shaded`."""
    for role, ss in r["rss"]["samples"].items():
        ax.plot([t for t, _ in ss], [kb / KB_PER_MB for _, kb in ss], lw=1, label=role)
    for a in shaded:
        a.axvspan(0, r["warmup_end_s"], color="0.9", zorder=0)
        a.axvspan(r["steady_end_s"], r["duration_s"], color="0.9", zorder=0)
    ax.set_ylabel("RSS (MB)")
    ax.set_xlabel("time since start (s); grey: warm-up and wind-down (not in the drift)")
    ax.legend(ncol=6, fontsize=7)


def save_figure(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
