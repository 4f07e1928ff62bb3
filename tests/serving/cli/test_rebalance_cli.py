"""Live re-placement as a user runs it: `moecomm frontend --eplb-interval` moves experts between
two `moecomm expert-server` processes while it serves, greedy completions stay the same, and
`moecomm rebalance` runs a pass on its own."""

import json
import subprocess
import time

import httpx
import pytest
from moecomm.testing import CLI_ARGV, Processes

CLI = list(CLI_ARGV)
ONE_THREAD = ("--threads", "1")
BODY = {
    "model": "tiny",
    "prompt": "live re-placement keeps every token",
    "max_tokens": 8,
    "temperature": 0.0,
    "ignore_eos": True,
    "return_token_ids": True,
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stages", [1, 2])
def test_frontend_eplb_interval_moves_experts_while_serving(mixtral_dir, stages):
    """With --stages 2 the experts are called from two stage processes, each with its own
    client: both pick up every new table."""
    with Processes() as procs:
        # A lopsided start: one server holds every expert, the other two of them, so the first
        # measured load calls for moves.
        args = [*procs.cli, "expert-server", "--checkpoint", str(mixtral_dir), *ONE_THREAD]
        servers = procs.start_many(
            (f"server-{i}", [*args, "--experts", experts])
            for i, experts in enumerate(("0-15", "0-1"))
        )
        urls = [s.url for s in servers]
        before = [httpx.get(f"{u}/experts", timeout=10).json()["layers"] for u in urls]
        fe = procs.moecomm(
            "frontend",
            [
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
        )
        fe_url = fe.url
        first = httpx.post(f"{fe_url}/v1/completions", json=BODY, timeout=120)
        assert first.status_code == 200, first.text
        tokens = first.json()["choices"][0]["token_ids"]
        moved, seen = None, []
        until = time.monotonic() + 120
        while moved is None and time.monotonic() < until:
            r = httpx.post(f"{fe_url}/v1/completions", json=BODY, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == tokens  # during the moves too
            for line in fe.lines()[len(seen) :]:
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
