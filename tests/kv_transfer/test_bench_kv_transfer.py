"""bench/wire/kv_transfer.py --quick runs end to end: two processes, every size and pattern timed
beside the memcpy floor and the staged path, into the shm pool and into engine tensors (CMA,
shm + copy), the goals evaluated, JSON and PNG written (no
figure is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from moecomm.testing import forking_env

ROOT = Path(__file__).resolve().parents[2]
# The quick run spawns one process and moves ~35 MiB; a loaded 2-core host needs a while.
BENCH_TIMEOUT_S = 240


def test_quick_bench_writes_its_results(tmp_path):
    out, png = tmp_path / "kv.json", tmp_path / "kv.png"
    proc = subprocess.run(
        [
            sys.executable,
            "bench/wire/kv_transfer.py",
            "--quick",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        cwd=ROOT,
        capture_output=True,
        env=forking_env(),  # its processes forked, as the suite's are
        text=True,
        timeout=BENCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [r["kib"] for r in result["rows"]] == [16, 1024, 16384]
    for r in result["rows"]:
        assert r["bytes"] == r["blocks"] * result["block_bytes"] == r["kib"] * 1024
        for key in (
            "memcpy_us",
            "contiguous_us",
            "scattered_us",
            "contiguous_send_us",
            "staged_us",
            "cma_contiguous_us",
            "cma_scattered_us",
            "shm_copy_contiguous_us",
            "shm_copy_scattered_us",
        ):
            assert r[key] > 0, key
        assert len(r["contiguous_samples_us"]) == 4
        assert len(r["cma_scattered_samples_us"]) == 4
    assert set(result["goals"]) == {
        "contiguous_ge_0.5x_memcpy_from_1024_kib",
        "scattered_ge_0.5x_memcpy_from_1024_kib",
        "cma_contiguous_ge_0.5x_memcpy_from_1024_kib",
        "cma_scattered_ge_0.5x_memcpy_from_1024_kib",
    }
    assert len(result["loadavg_before"]) == 3
    assert png.stat().st_size > 0
