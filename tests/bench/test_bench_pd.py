"""bench/serving/pd.py, short enough for CI: the real script (monitor, two expert servers, then one
front end, then a prefill + decode front end behind `moecomm router` always splitting, then
behind a conditional router, all from the `moecomm` CLI) with --quick, and its JSON read back:
every contender and every field are there. Speed is not asserted: CI machines are shared and
small."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from moecomm.testing import forking_env

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
SCRIPT = BENCH_DIR / "serving" / "pd.py"
# ~75 s on a quiet 2-core machine (ten torch imports, 3 x 4 s of load); the margin is for a
# loaded one.
RUN_TIMEOUT_S = 240
MIXED_FIELDS = (
    "short_requests",
    "long_requests",
    "failed",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_quantiles_ms",
    "first_gap_p50_ms",
    "decode_itl_p99_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "ttft_short_p50_ms",
    "ttft_short_p99_ms",
    "ttft_long_p50_ms",
    "ttft_long_p99_ms",
    "output_tokens_per_s",
)
KV_FIELDS = (
    "handoffs",
    "bytes",
    "seconds",
    "context_tokens",
    "bytes_per_request",
    "transfer_s_per_token",
    "failures",
)
PREFIX_FIELDS = (
    "ttft_miss_p50_ms",
    "ttft_hit_p50_ms",
    "ttft_saved_p50_ms",
    "cache_hit_rate",
    "cache_estimated_saved_s",
)


def pd_bench():
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    import pd

    return pd


def test_long_arrivals_are_seeded_and_one_per_interval():
    pd = pd_bench()
    cfg = pd.PdBenchConfig(duration_s=20.0, long_every_s=4.0)
    a = pd.long_arrivals(cfg)
    assert a == pd.long_arrivals(cfg)  # both contenders get the same load
    assert a != pd.long_arrivals(pd.PdBenchConfig(duration_s=20.0, long_every_s=4.0, seed=1))
    assert len(a) == 5 and all(4.0 * k <= t < 4.0 * (k + 1) for k, t in enumerate(a))


@pytest.mark.parametrize(
    "bad",
    [{"clients": 0}, {"short_output": 1}, {"long_input": 4096}, {"prefix_requests": 0}],
)
def test_bad_config_is_refused(bad):
    with pytest.raises(SystemExit):
        pd_bench().PdBenchConfig(**bad).check()


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_quick_run_writes_both_contenders(tmp_path):
    out, png = tmp_path / "pd.json", tmp_path / "pd.png"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=forking_env(),
    )
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, log
    r = json.loads(out.read_text())["pd"]
    assert r["ok"] and r["failures"] == [], r["failures"]
    contenders = ["single", "split", "conditional"]
    assert [m["contender"] for m in r["mixed"]] == contenders
    assert [m["contender"] for m in r["shared_prefix"]] == contenders
    for m in r["mixed"]:
        assert set(MIXED_FIELDS) <= set(m), m.keys()
        assert m["short_requests"] > 0 and m["long_requests"] > 0 and m["failed"] == 0
    assert set(KV_FIELDS) <= set(r["mixed"][1]["kv"])
    assert r["mixed"][1]["kv"]["handoffs"] > 0  # the split did hand KV off
    # the always-split router prefilled nothing on the decode side; the conditional one did
    # (the quick load's short prompts are under its default --max-local-prefill-tokens)
    assert r["mixed"][1]["prefills"]["local_short"] == 0
    assert r["mixed"][2]["prefills"]["local_short"] > 0
    assert set(r["conditional_ratios"]) == {"over_single", "over_split"}
    for p in r["shared_prefix"]:
        assert set(PREFIX_FIELDS) <= set(p), p.keys()
    assert {"itl_p99_ratio", "ttft_p50_ratio", "itl_p99_met", "ttft_p50_met"} <= set(r["goals"])
    assert png.stat().st_size > 0
