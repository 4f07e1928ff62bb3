"""The etcd membership backend across hosts, without a cluster: etcd runs in a network namespace
of its own (moecomm.netns), the expert servers in two others, the front end's pipeline driver
with its first stage in a fourth and its second stage under a stage agent in a fifth. Everyone
finds everyone through etcd on the lab's bridge (no embedded monitor anywhere): the servers
register there, each stage's attention client discovers them there and reaches them over nixl,
greedy tokens equal the in-process model, and a server killed with SIGKILL drops out of the
membership once its lease runs out, as seen from the front end's namespace."""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path

import pytest
import torch
from lab_procs import start_logged, wait_for_log, wait_ready
from membership_procs import etcd_binary
from moecomm import netns
from moecomm.wire.nixl import available as nixl_available

lab_ok, lab_why = netns.available()
nixl_ok, nixl_why = nixl_available()
pytestmark = [
    pytest.mark.skipif(not lab_ok, reason=f"network namespaces cannot be made: {lab_why}"),
    pytest.mark.skipif(not nixl_ok, reason=f"NIXL is not installed: {nixl_why}"),
]

PY = [sys.executable, "-X", "faulthandler"]
CLI = [*PY, "-m", "moecomm_serving.cli"]
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380
SERVER_PORT, AGENT_PORT = 8100, 7400
# etcd's own timing, scaled down as tests/membership_procs.py does, so 1 s leases are allowed.
ETCD_HEARTBEAT_MS, ETCD_ELECTION_MS = 10, 50
# The line etcd 3.4 logs once its client listener serves.
ETCD_READY = "ready to serve client requests"
# Lease of the expert servers: short so the loss shows quickly, long enough for a loaded
# 2-core machine to keep it alive.
TTL_S = 1
# How late after its TTL a killed server may still be listed: etcd checks lease expiry every
# 500 ms, plus the watcher's poll and a loaded machine.
LOSS_SLACK_S = 4.0
START_S = 120.0
DRIVER_S = 240.0
NEW = 8
PROMPTS = [[(5 * i + j) % 200 + 1 for j in range(4 + 3 * i)] for i in range(3)]

# The front end's side, in its own namespace: waits until etcd lists both servers, decodes
# through a two-stage pipeline whose stages discover the servers in etcd, then (once the test has
# killed a server) watches the membership until the dead server's lease is gone.
DRIVER = r"""
import json, os, sys, time


def servers(ms):
    return sorted(m.member_id for m in ms.list_members() if m.role == "server")


def main():
    args = json.load(open(sys.argv[1]))
    from moecomm.membership import connect_membership
    from moecomm.pipeline.driver import run_decode
    from moecomm_serving.engine.stages import model_pipeline
    from moecomm_serving.model.remote_experts import RemoteExperts
    out = {}
    with connect_membership(args["etcd"]) as ms:
        deadline = time.monotonic() + 60
        while len(servers(ms)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        out["before"] = servers(ms)
        remote = RemoteExperts(monitor=args["etcd"], transport="nixl", host=args["host"])
        with model_pipeline(args["ckpt"], 2, remote=remote, stage_hosts=args["places"],
                            host=args["host"], stage_token=args["token"]) as pipe:
            out["stage_transports"] = sorted(set(pipe.transports.values()))
            out["tokens"] = run_decode(pipe, args["prompts"], args["new"]).tokens
        print("decoded", flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(args["flag"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        while len(servers(ms)) > 1 and time.monotonic() - t0 < args["loss_wait"]:
            time.sleep(0.05)
        out["after"] = servers(ms)
        out["loss_seconds"] = time.monotonic() - t0
    json.dump(out, open(args["out"], "w"))
    print("driver done", flush=True)


if __name__ == "__main__":  # stage 0 is spawned: it re-imports this file
    main()
"""


def etcd_argv(binary: str, addr: str, data_dir: Path) -> list[str]:
    client = f"http://{addr}:{ETCD_CLIENT_PORT}"
    # Peers only on the namespace's loopback: a single-member cluster has none to talk to.
    peer = f"http://127.0.0.1:{ETCD_PEER_PORT}"
    return [
        binary,
        "--name=moecomm-lab",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=moecomm-lab={peer}",
        f"--heartbeat-interval={ETCD_HEARTBEAT_MS}",
        f"--election-timeout={ETCD_ELECTION_MS}",
    ]


@pytest.mark.timeout(360)
def test_etcd_in_its_own_namespace_serves_servers_frontend_and_stages(tiny_mixtral_dir, tmp_path):
    from moecomm_serving.engine.generate import generate
    from moecomm_serving.model.transformer import load_model
    from moecomm_serving.types import SamplingParams

    binary = etcd_binary()
    token = secrets.token_hex(32)
    key = tmp_path / "stage.key"
    key.write_text(token)
    key.chmod(0o600)
    flag = tmp_path / "killed"
    logs = {n: tmp_path / f"{n}.log" for n in ("etcd", "s1", "s2", "agent", "fe")}
    with netns.Lab() as lab:
        eh, s1, s2, ah, fe = (lab.add_host(n) for n in ("etcd", "s1", "s2", "st", "fe"))
        deadline = time.monotonic() + START_S
        e = start_logged(lab, eh, etcd_argv(binary, eh.addr, tmp_path / "etcd-data"), logs["etcd"])
        wait_for_log(logs["etcd"], ETCD_READY, e, deadline)
        etcd_url = f"etcd://{eh.addr}:{ETCD_CLIENT_PORT}/t{secrets.token_hex(4)}"
        servers = {}
        for name, h in (("s1", s1), ("s2", s2)):
            argv = [
                *CLI, "expert-server", "--checkpoint", str(tiny_mixtral_dir),
                "--host", h.addr, "--port", str(SERVER_PORT), "--transport", "nixl",
                "--threads", "1", "--monitor", etcd_url, "--ttl", str(TTL_S),
            ]  # fmt: skip
            servers[name] = start_logged(lab, h, argv, logs[name])
        agent_argv = [*PY, "-m", "moecomm.pipeline.agent", "--host", ah.addr]
        agent_argv += ["--port", str(AGENT_PORT), "--token-file", str(key)]
        agent = start_logged(lab, ah, agent_argv, logs["agent"])
        for name, p in (*servers.items(), ("agent", agent)):
            wait_ready(logs[name], p, deadline)
        args = {
            "etcd": etcd_url,
            "ckpt": str(tiny_mixtral_dir),
            "places": ["local", f"{ah.addr}:{AGENT_PORT}"],
            "host": fe.addr,
            "token": token,
            "prompts": PROMPTS,
            "new": NEW,
            "flag": str(flag),
            "loss_wait": TTL_S + LOSS_SLACK_S,
            "out": str(tmp_path / "out.json"),
        }
        script, cfg = tmp_path / "driver.py", tmp_path / "driver.json"
        script.write_text(DRIVER)
        cfg.write_text(json.dumps(args))
        d = start_logged(lab, fe, [*PY, str(script), str(cfg)], logs["fe"])
        wait_for_log(logs["fe"], "decoded", d, time.monotonic() + DRIVER_S)
        lab.kill(servers["s2"])  # SIGKILL: its lease is left to expire
        flag.write_text("1")
        assert d.wait(timeout=DRIVER_S) == 0, logs["fe"].read_text()[-3000:]
        got = json.loads(Path(args["out"]).read_text())
        print(json.dumps({k: got[k] for k in ("before", "after", "loss_seconds")}))

    model = load_model(tiny_mixtral_dir, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    want = [g.tokens for g in generate(model, PROMPTS, params)]
    assert got["tokens"] == want
    assert len(got["before"]) == 2, got["before"]
    assert got["stage_transports"] == ["nixl"]  # the two stages are in different namespaces
    # The killed server's lease ran out; the survivor is still listed.
    assert len(got["after"]) == 1 and got["after"][0] in got["before"], got
    assert got["loss_seconds"] < TTL_S + LOSS_SLACK_S, got
