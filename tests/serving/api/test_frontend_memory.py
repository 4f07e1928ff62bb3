"""The front end's per-request state stays bounded when nobody scrapes /metrics (the soak's
front end once grew ~0.8 kB per request; bench/serving/frontend_memory.py finds the sites)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

from moecomm_serving.api.metrics import THROUGHPUT_WINDOW_S, ServingMetrics

# Tokens per simulated second, and seconds simulated: 50 windows of the tokens/s gauge, so a
# structure that keeps every token holds 50x what one that keeps a window holds.
TOKENS_PER_S = 200
WINDOWS = 50


def _metrics() -> ServingMetrics:
    return ServingMetrics(queue_depth=lambda: 0, running=lambda: 0, failovers=lambda: 0)


def _feed(m: ServingMetrics, t0: float, seconds: float) -> float:
    """`seconds` of tokens at TOKENS_PER_S, timestamps from t0; returns the last one."""
    now = t0
    for i in range(int(seconds * TOKENS_PER_S)):
        now = t0 + i / TOKENS_PER_S
        m.on_token(None if i == 0 else 1.0 / TOKENS_PER_S, now)
    return now


def test_tokens_per_second_window_stays_bounded_without_scrapes():
    m = _metrics()
    now = _feed(m, 1000.0, WINDOWS * THROUGHPUT_WINDOW_S)
    # at most one window of tokens (+1: the boundary) kept, though /metrics was never read
    assert len(m._recent) <= THROUGHPUT_WINDOW_S * TOKENS_PER_S + 1
    # and the gauge still counts the window's tokens (both ends are in: one token more)
    assert abs(m.tokens_per_second(now) - TOKENS_PER_S) <= 1.0 / THROUGHPUT_WINDOW_S + 1e-9
    assert m.generation_tokens == WINDOWS * THROUGHPUT_WINDOW_S * TOKENS_PER_S


def test_metrics_memory_is_flat_per_token_once_the_window_is_full():
    """Traced bytes after 1 window of tokens and after 10 more: equal within a deque block's
    slack, where keeping every token grows by ~64 B per token (a tuple and a deque slot)."""
    m = _metrics()
    tracemalloc.start()
    try:
        now = _feed(m, 0.0, THROUGHPUT_WINDOW_S)
        full = tracemalloc.get_traced_memory()[0]
        _feed(m, now, 10 * THROUGHPUT_WINDOW_S)
        grown = tracemalloc.get_traced_memory()[0] - full
    finally:
        tracemalloc.stop()
    tokens = 10 * THROUGHPUT_WINDOW_S * TOKENS_PER_S
    assert grown / tokens < 1.0, f"{grown} B for {tokens} tokens"


# bench/serving/frontend_memory.py end to end, a few dozen requests: the script keeps working
# (front end in this test's child, its client in a grandchild, tracemalloc sites and their holders).
SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "serving" / "frontend_memory.py"
# One torch import (the client imports httpx only) and 40 tiny requests with tracemalloc on
# (~5 per second on 2 busy cores), with a wide margin.
SCRIPT_TIMEOUT_S = 240


def test_the_memory_bench_reports_growth_sites(tmp_path):
    out = tmp_path / "mem.json"
    args = ["--requests", "40", "--every", "20", "--baseline", "20", "--clients", "2"]
    args += ["--explain", "1", "--json", str(out)]
    p = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its client is in the group: one kill ends both
    )
    try:
        log, _ = p.communicate(timeout=SCRIPT_TIMEOUT_S)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, log
    r = json.loads(out.read_text())["frontend_memory"]
    assert [c["requests"] for c in r["checkpoints"]] == [20, 40]
    assert all(c["errors"] == 0 for c in r["checkpoints"])
    g = r["growth"]
    assert (g["from_requests"], g["to_requests"]) == (20, 40)
    assert g["generated_tokens_per_request"] > 0
    assert g["by_line"] and g["by_traceback"] and len(g["holders"]) == 1
