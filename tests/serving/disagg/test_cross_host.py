"""Experts on other hosts, without a cluster: the monitor, the expert servers and the front end
each run in a network namespace of their own (a bridge in a namespace of its own joins them;
addresses in a private test subnet), with a private /dev/shm and their own IPC and PID
namespaces, so neither moecomm's shm nor UCX's shared-memory transports can carry a byte: only
the network can. Greedy generation through that deployment equals the in-process model, also
when one server is killed with SIGKILL mid-generation (its replica answers) and a new server
joins from a new namespace while generation goes on."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from moecomm import netns
from moecomm.wire.nixl import available as nixl_available
from moecomm_serving.engine.generate import generate
from moecomm_serving.model.tokenizer import ByteTokenizer
from moecomm_serving.types import SamplingParams

lab_ok, lab_why = netns.available()
nixl_ok, nixl_why = nixl_available()
pytestmark = [
    pytest.mark.skipif(not lab_ok, reason=f"network namespaces cannot be made: {lab_why}"),
    pytest.mark.skipif(not nixl_ok, reason=f"NIXL is not installed: {nixl_why}"),
]

CLI = [sys.executable, "-X", "faulthandler", "-m", "moecomm_serving.cli"]
DRIVER = str(Path(__file__).resolve().parents[1] / "cross_host_driver.py")
MONITOR_PORT, SERVER_PORT = 7100, 8100
TOKEN = "cross-host-token"
NEW_TOKENS = 16
KILL_AT_STEP = 3  # the victim dies while step KILL_AT_STEP + 1 is in flight
START_S = 120.0


def wait_for(log: Path, text: str, proc, deadline: float) -> str:
    """The first line of `log` that contains `text`; fails when `proc` exits first."""
    while time.monotonic() < deadline:
        if log.exists():
            for line in log.read_text(errors="replace").splitlines():
                if text in line:
                    return line
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[-1]!r} exited ({proc.returncode}): {log.read_text()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"no {text!r} in {log} in time: {log.read_text()[-3000:] if log.exists() else ''}")


def start(lab, host, argv, log: Path, env):
    f = open(log, "w")  # noqa: SIM115 - the child writes it; closed with the lab
    return lab.spawn(host, argv, env=env, stdout=f, stderr=f)


def server_argv(ckpt, host, monitor) -> list[str]:
    return [
        *CLI,
        "expert-server",
        "--checkpoint",
        str(ckpt),
        "--host",
        host.addr,
        "--port",
        str(SERVER_PORT),
        "--transport",
        "nixl",
        "--threads",
        "1",
    ] + (
        []
        if monitor is None
        else ["--monitor", f"http://{monitor.addr}:{MONITOR_PORT}", "--ttl", "1"]
    )


@pytest.mark.timeout(420)
def test_generation_across_namespaces_survives_a_kill_9_and_a_join(mixtral_dir, mixtral, tmp_path):
    env = {**os.environ, "MOECOMM_MONITOR_TOKEN": TOKEN}
    with netns.Lab() as lab:
        mon = lab.add_host("mon")
        s1, s2, fe = (lab.add_host(n) for n in ("s1", "s2", "fe"))
        deadline = time.monotonic() + START_S
        logs = {n: tmp_path / f"{n}.log" for n in ("mon", "s1", "s2", "s3", "fe")}
        m = start(
            lab,
            mon,
            [*CLI, "monitor", "--host", mon.addr, "--port", str(MONITOR_PORT)],
            logs["mon"],
            env,
        )
        wait_for(logs["mon"], "http://", m, deadline)
        procs = {
            n: start(lab, h, server_argv(mixtral_dir, h, mon), logs[n], env)
            for n, h in (("s1", s1), ("s2", s2))
        }
        for n, p in procs.items():
            wait_for(logs[n], "listening on", p, deadline)
        out = tmp_path / "driver.json"
        driver = start(
            lab,
            fe,
            [
                sys.executable,
                "-X",
                "faulthandler",
                DRIVER,
                "--checkpoint",
                str(mixtral_dir),
                "--monitor",
                f"http://{mon.addr}:{MONITOR_PORT}",
                "--host",
                fe.addr,
                "--tokens",
                str(NEW_TOKENS),
                "--out",
                str(out),
            ],
            logs["fe"],
            env,
        )
        wait_for(logs["fe"], f"step {KILL_AT_STEP}", driver, time.monotonic() + START_S)
        lab.kill(procs["s2"])  # SIGKILL, mid-generation
        s3 = lab.add_host("s3")
        procs["s3"] = start(lab, s3, server_argv(mixtral_dir, s3, mon), logs["s3"], env)
        wait_for(logs["s3"], "listening on", procs["s3"], time.monotonic() + START_S)
        assert driver.wait(timeout=240) == 0, logs["fe"].read_text()[-3000:]
        got = json.loads(out.read_text())
        print(json.dumps({k: got[k] for k in ("failovers", "joined", "transports")}))

    tok = ByteTokenizer()
    prompts = [tok.encode(t) for t in ("experts on other hosts", "kill one and keep going")]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    want = [g.tokens for g in generate(mixtral, prompts, params)]
    assert got["tokens"] == want
    s3_url = f"http://{s3.addr}:{SERVER_PORT}"
    assert got["joined"] == s3_url
    # Every server the front end talks to speaks nixl: the namespaces share no memory.
    assert set(v for v in got["transports"].values() if v is not None) == {"nixl"}
    # The newcomer served part of the second half (replicas are used in turn).
    assert got["health"][s3_url]["seconds_since_last_served"] is not None


QUERY = """
import json, sys, httpx
body = {"model": "m", "prompt": sys.argv[2], "max_tokens": int(sys.argv[3]), "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True}
r = httpx.post(sys.argv[1] + "/v1/completions", json=body, timeout=120)
print(json.dumps({"status": r.status_code, "body": r.json()}))
"""


@pytest.mark.timeout(300)
def test_the_frontend_cli_serves_over_nixl_from_another_namespace(mixtral_dir, mixtral, tmp_path):
    """`moecomm expert-server --transport nixl --host A` and `moecomm frontend --transport nixl
    --host B` in two namespaces: a greedy completion equals the in-process model's."""
    prompt, n = "the front end is elsewhere", 8
    with netns.Lab() as lab:
        sh, fh = lab.add_host("srv"), lab.add_host("fe")
        deadline = time.monotonic() + START_S
        logs = {n: tmp_path / f"{n}.log" for n in ("srv", "fe")}
        argv = server_argv(mixtral_dir, sh, None)
        s = start(lab, sh, argv, logs["srv"], dict(os.environ))
        wait_for(logs["srv"], "listening on", s, deadline)
        fe_argv = [
            *CLI,
            "frontend",
            "--checkpoint",
            str(mixtral_dir),
            "--servers",
            f"http://{sh.addr}:{SERVER_PORT}",
            "--transport",
            "nixl",
            "--host",
            fh.addr,
            "--port",
            "8000",
            "--model-name",
            "m",
            "--threads",
            "1",
        ]
        f = start(lab, fh, fe_argv, logs["fe"], dict(os.environ))
        wait_for(logs["fe"], "listening on", f, deadline)
        rc, out, err = lab.run(
            fh, [sys.executable, "-c", QUERY, f"http://{fh.addr}:8000", prompt, str(n)], 120
        )
        assert rc == 0, err[-2000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["status"] == 200, got
    tok = ByteTokenizer()
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    (want,) = generate(mixtral, [tok.encode(prompt)], params)
    assert got["body"]["choices"][0]["token_ids"] == want.tokens[-n:]
