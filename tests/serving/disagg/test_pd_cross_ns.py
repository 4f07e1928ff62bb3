"""The prefill/decode split across "hosts": a prefill front end, a decode front end and the
router each in a network namespace of its own (moecomm.netns: own network, /dev/shm and PIDs),
so the KV hand-off can only go over the network — the per-peer choice must pick nixl — and the
greedy tokens through the router equal the model in one process."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from lab_procs import start_logged, wait_ready
from moecomm import netns
from moecomm.wire.nixl import available as nixl_available
from moecomm_serving.engine.generate import generate
from moecomm_serving.model.tokenizer import load_tokenizer
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams

lab_ok, lab_why = netns.available()
nixl_ok, nixl_why = nixl_available()
pytestmark = [
    pytest.mark.skipif(not lab_ok, reason=f"network namespaces cannot be made: {lab_why}"),
    pytest.mark.skipif(not nixl_ok, reason=f"NIXL is not installed: {nixl_why}"),
]

PY = [sys.executable, "-X", "faulthandler"]
CLI = [*PY, "-m", "moecomm_serving.cli"]
# Importing torch and moecomm in a fresh interpreter on a loaded 2-core machine.
START_S = 120.0
ASK_S = 240.0
PORT = 8000
PROMPTS = ["prefill here, decode there", "a"]
NEW = 8
# Runs in the router's namespace: each prompt through the router, then the prefill front end's
# metrics (which transport the KV packages took).
ASK = r"""
import json, sys
import httpx
router, prefill, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
prompts = json.loads(sys.argv[5])
c = httpx.Client(trust_env=False, timeout=120)
answers = []
for p in prompts:
    body = {"model": "tiny", "prompt": p, "max_tokens": n, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    r = c.post(f"{router}/v1/completions", json=body)
    answers.append({"status": r.status_code, "body": r.json()})
metrics = c.get(f"{prefill}/metrics").text
json.dump({"answers": answers, "metrics": metrics}, open(out, "w"))
"""


@pytest.mark.timeout(420)
def test_split_across_namespaces_hands_kv_over_nixl(tiny_mixtral_dir, tmp_path: Path):
    ckpt = str(tiny_mixtral_dir)
    # the split's routes listen beyond loopback here: the deployment's secret guards them
    secret = tmp_path / "pd-secret"
    secret.write_text("cross-namespace-deployment-secret")
    guard = ["--pd-secret-file", str(secret)]
    with netns.Lab() as lab:
        hp, hd, hr = lab.add_host("p"), lab.add_host("d"), lab.add_host("r")
        started = []
        for host, role in ((hp, "prefill"), (hd, "decode")):
            argv = [
                *CLI, "frontend", "--checkpoint", ckpt, "--model-name", "tiny", "--local-experts",
                "--role", role, "--transport", "auto", "--host", host.addr, "--port", str(PORT),
                "--threads", "1", *guard,
            ]  # fmt: skip
            log = tmp_path / f"{role}.log"
            started.append((start_logged(lab, host, argv, log), log))
        for proc, log in started:
            wait_ready(log, proc, time.monotonic() + START_S)
        urls = {h.name: f"http://{h.addr}:{PORT}" for h in (hp, hd, hr)}
        argv = [
            *CLI, "router", "--checkpoint", ckpt, "--model-name", "tiny",
            "--prefill", urls["p"], "--decode", urls["d"], "--host", hr.addr, "--port", str(PORT),
            "--max-local-prefill-tokens", "0", *guard,  # every prompt handed off
        ]  # fmt: skip
        rlog = tmp_path / "router.log"
        router = start_logged(lab, hr, argv, rlog)
        wait_ready(rlog, router, time.monotonic() + START_S)
        script, out = tmp_path / "ask.py", tmp_path / "answer.json"
        script.write_text(ASK)
        rc, so, se = lab.run(
            hr,
            [*PY, str(script), urls["r"], urls["p"], str(NEW), str(out), json.dumps(PROMPTS)],
            timeout=ASK_S,
        )
        logs = "".join(p.read_text(errors="replace")[-2000:] for p in tmp_path.glob("*.log"))
        assert rc == 0, so + se + logs
    got = json.loads(out.read_text())
    model = load_model(ckpt, dtype=torch.float32)
    tok = load_tokenizer(ckpt, model.config)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    want = [g.tokens for g in generate(model, [tok.encode(p) for p in PROMPTS], params)]
    for a, w in zip(got["answers"], want, strict=True):
        assert a["status"] == 200, (a, logs)
        assert a["body"]["choices"][0]["token_ids"] == w
    assert (
        f'moecomm_kv_handoff_sent_by_transport_total{{transport="nixl"}} {len(PROMPTS)}'
        in (got["metrics"])
    ), got["metrics"][-3000:]
