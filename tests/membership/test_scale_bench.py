"""bench/scale/scale.py --quick runs from a clean tree (real monitor, real etcd, member-host
processes) and writes a JSON whose figures agree with each other and a plot. Speed is not
asserted here: the bench reports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The quick mode takes ~25 s on a quiet 2-core machine; several times that under load.
BENCH_TIMEOUT_S = 280
ROW_KEYS = {
    "backend",
    "mode",
    "n",
    "ttl_s",
    "hosts",
    "register_s",
    "listed_after_register",
    "window_s",
    "backend_cpu_cores",
    "backend_rss_mb",
    "hosts_cpu_cores",
    "heartbeat_p50_ms",
    "heartbeat_p99_ms",
    "requests_per_s",
    "requests_per_s_per_member",
    "listed_after_window",
    "evicted_in_window",
    "change_to_all_watchers_s",
    "change_to_all_watchers_max_s",
    "death_to_removal_s",
    "death_to_removal_leases",
}


@pytest.mark.timeout(BENCH_TIMEOUT_S + 20)
def test_quick_scale_bench_writes_consistent_json(tmp_path, etcd_process):
    # etcd_process: installs etcd when it is missing (the bench starts its own).
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    script = "bench/scale/scale.py"
    cmd = [sys.executable, script, "--quick", "--json", str(out), "--plot", str(png)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert data["failures"] == []
    assert {(row["backend"], row["mode"]) for row in data["rows"]} == {
        ("monitor", "grouped"),
        ("etcd", "grouped"),
    }
    for row in data["rows"]:
        assert row.keys() >= ROW_KEYS, ROW_KEYS - row.keys()
        n = row["n"]
        assert row["listed_after_register"] == n
        assert row["listed_after_window"] + row["evicted_in_window"] == n
        assert row["requests_per_s_per_member"] == pytest.approx(row["requests_per_s"] / n)
        assert 0 < row["heartbeat_p50_ms"] <= row["heartbeat_p99_ms"]
        assert row["backend_cpu_cores"] >= 0 and row["hosts_cpu_cores"] >= 0
        assert row["backend_rss_mb"] > 0
        assert row["change_to_all_watchers_max_s"] == max(row["change_to_all_watchers_s"])
        assert row["death_to_removal_leases"] == pytest.approx(
            row["death_to_removal_s"] / row["ttl_s"]
        )
        key = f"{row['backend']}/{row['mode']}"
        assert data["model"][key]["sizes"] == [n]
    # The placement controller's reads of simulated servers' tables.
    assert [r["servers"] for r in data["placement"]] == [10]
    for r in data["placement"]:
        assert r["answered_min"] == r["servers"]
        assert 0 < r["read_s_median"] <= r["read_s_max"]
        assert r["requests_per_s_total"] == pytest.approx(
            r["servers"] * r["requests_per_s_per_server"]
        )
        assert r["keeps_watch_period"] == (r["read_s_median"] <= r["watch_period_s"])
    drill = next(row["drill"] for row in data["rows"] if row["backend"] == "monitor")
    assert drill["killed"] + drill["survivors"] == drill["members"]
    assert drill["killed"] == round(drill["members"] * 0.1)
    # The drill's outcome is correctness, not speed: every survivor back, none evicted, the
    # dead ones gone.
    assert drill["survivors_listed"] == drill["survivors"]
    assert drill["live_members_evicted"] == 0
    assert drill["dead_listed"] == 0
    assert drill["dead_reported_lost"] == drill["killed"]


# The short placement-watch and connect benches: ~1 min on a quiet 2-core machine.
SHORT_BENCH_TIMEOUT_S = 280


@pytest.mark.timeout(2 * SHORT_BENCH_TIMEOUT_S + 20)
def test_short_placement_watch_and_connect_benches_write_consistent_json(tmp_path):
    watch_json, connect_json = tmp_path / "watch.json", tmp_path / "connect.json"
    for cmd in (
        ["bench/scale/scale_placement.py", "--compare", "--sizes", "3", "--seconds", "1"],
        ["bench/scale/scale_connect.py", "--sizes", "1x2"],
    ):
        out = watch_json if "--compare" in cmd else connect_json
        r = subprocess.run(
            [sys.executable, *cmd, "--json", str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=SHORT_BENCH_TIMEOUT_S,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(watch_json.read_text())["rows"]
    assert [(r["servers"], r["watch"]) for r in rows] == [(3, "polling"), (3, "notified")]
    for r in rows:
        # "seconds" is rounded to ms in the JSON.
        assert r["reads_per_s_total"] == pytest.approx(r["table_reads"] / r["seconds"], rel=1e-2)
        assert len(r["loadavg"]) == 3
    data = json.loads(connect_json.read_text())
    assert data["failures"] == []
    (row,) = data["rows"]
    assert (row["clients"], row["servers"], row["pairs"]) == (1, 2, 2)
    assert 0 < row["connect_s_median"] <= row["connect_s_max"]
    assert row["connect_per_server_s_median"] == pytest.approx(row["connect_s_median"] / 2)
    # Every pair has slot regions while connected; none is left once the clients closed.
    assert row["shm_files"] > 0 and row["shm_bytes_per_pair"] > 0
    assert row["shm_files_left_after_close"] == 0
