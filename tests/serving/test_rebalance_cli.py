"""Live re-placement as a user runs it: `moecomm frontend --eplb-interval` moves experts between
two `moecomm expert-server` processes while it serves, greedy completions stay the same, and
`moecomm rebalance` runs a pass on its own."""

import json
import queue
import subprocess
import sys
import threading
import time

import httpx
import pytest
from proc_helpers import read_line

CLI = [sys.executable, "-m", "moecomm_serving.cli"]
START_S = 120.0
ONE_THREAD = ("--threads", "1")
BODY = {
    "model": "tiny",
    "prompt": "live re-placement keeps every token",
    "max_tokens": 8,
    "temperature": 0.0,
    "ignore_eos": True,
    "return_token_ids": True,
}


def lines_of(proc) -> queue.Queue:
    """Every stdout line of `proc`, collected by a thread (the test reads without blocking)."""
    out: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            out.put(line.rstrip())

    threading.Thread(target=pump, daemon=True).start()
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stages", [1, 2])
def test_frontend_eplb_interval_moves_experts_while_serving(mixtral_dir, stages):
    """With --stages 2 the experts are called from two stage processes, each with its own
    client: both pick up every new table."""
    procs = []
    try:
        deadline = time.monotonic() + START_S
        urls = []
        # A lopsided start: one server holds every expert, the other two of them, so the first
        # measured load calls for moves.
        for experts in ("0-15", "0-1"):
            args = ["expert-server", "--checkpoint", str(mixtral_dir), "--experts", experts]
            es = subprocess.Popen(
                [*CLI, *args, *ONE_THREAD],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(es)
            line = read_line(es, "expert server", deadline)
            urls.append(line.split(" listening on ")[1].split(": layers")[0])
        before = [httpx.get(f"{u}/experts", timeout=10).json()["layers"] for u in urls]
        fe = subprocess.Popen(
            [
                *CLI,
                "frontend",
                "--checkpoint",
                str(mixtral_dir),
                "--servers",
                ",".join(urls),
                "--port",
                "0",
                "--model-name",
                "tiny",
                "--eplb-interval",
                "1",
                "--eplb-min-tokens",
                "16",
                "--stages",
                str(stages),
                *ONE_THREAD,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(fe)
        fe_url = read_line(fe, "frontend ", deadline).split(" listening on ")[1]
        out = lines_of(fe)
        first = httpx.post(f"{fe_url}/v1/completions", json=BODY, timeout=120)
        assert first.status_code == 200, first.text
        tokens = first.json()["choices"][0]["token_ids"]
        moved, seen = None, []
        until = time.monotonic() + 120
        while moved is None and time.monotonic() < until:
            r = httpx.post(f"{fe_url}/v1/completions", json=BODY, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == tokens  # during the moves too
            while not out.empty():
                line = out.get()
                seen.append(line)
                if line.startswith("frontend: rebalance:") and "loaded" in line:
                    moved = line
        assert moved is not None, "\n".join(seen)
        assert "errors" not in moved, moved
        time.sleep(1.5)  # the dropped replicas leave once the front end has the new table
        after = [httpx.get(f"{u}/experts", timeout=10).json()["layers"] for u in urls]
        assert after != before
        r = httpx.post(f"{fe_url}/v1/completions", json=BODY, timeout=120)
        assert r.json()["choices"][0]["token_ids"] == tokens
        # One pass of `moecomm rebalance` from the outside: a JSON report, exit 0.
        if stages > 1:
            return
        rb = subprocess.run(
            [*CLI, "rebalance", "--servers", ",".join(urls), "--json", "--min-tokens", "1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert rb.returncode == 0, rb.stdout + rb.stderr
        report = json.loads(rb.stdout.strip().splitlines()[-1])
        assert report["servers"] == 2 and report["errors"] == []
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
