"""Redundancy restored on its own (`min_replicas`, issue 28): with every expert on two expert
servers, a kill -9 of one leaves each expert served by the other copy, and the placement
controller's watch re-homes the lost copies on the survivors at once (no load-driven pass is
due), while a client keeps completing requests whose outputs equal the fault-free ones."""

import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from moecomm.runtime import ExpertServer
from moecomm.runtime.control import HttpServer, make_app
from moecomm.runtime.experts import LayerExperts
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.runtime.placement import PlacementController
from moecomm.testing.clients import connect_client

SPEC = ModelSpec(num_layers=2, num_experts=12, hidden=64, intermediate=32, seed=11)
TOKEN = "t0ken"
TOPK = 2
MAX_TOKENS = 32
K = 2
# Three servers, every expert on two of them: server i holds experts 4i .. 4i + 7 (mod 12).
HOSTED = [{layer: [(4 * i + j) % 12 for j in range(8)] for layer in (0, 1)} for i in range(3)]
# The watch's period here: detection is a small part of the restore (loads dominate).
WATCH_S = 0.05
# A restore on this 2-core machine takes well under a second (bench/recovery/redundancy.py);
# the deadline leaves room for a loaded CI machine.
RESTORE_DEADLINE_S = 30.0
# No load-driven pass may run during the test: only the watch moves experts.
NEVER_S = 3600.0


def copies(urls: list[str]) -> dict[int, list[int]]:
    """{layer: servers publishing each expert}, over the servers at `urls`."""
    out = {layer: [0] * SPEC.num_experts for layer in range(SPEC.num_layers)}
    for url in urls:
        table = httpx.get(f"{url}/experts", params={"load": "false"}, timeout=10).json()
        for layer, ids in table["layers"].items():
            for e in {e for e in ids if e >= 0}:
                out[int(layer)][e] += 1
    return out


def monolith(x, ids, w, layer):
    (y,) = LayerExperts(layer, SPEC.experts()[layer]).forward([x], [ids], [w])
    return y


@pytest.mark.timeout(240)
def test_kill_9_of_a_server_restores_every_expert_to_two_copies_while_serving():
    procs = []
    client = controller = None
    stop, errors, done = threading.Event(), [], []
    try:
        procs = [spawn_expert_server(SPEC, h, f"mr{i}", TOKEN) for i, h in enumerate(HOSTED)]
        urls = [p.url for p in procs]
        assert all(min(c) == K for c in copies(urls).values())
        client = connect_client(urls, SPEC.hidden, TOPK, MAX_TOKENS, token=TOKEN, timeout=20.0)
        # Pulled from peers (the path this test follows); the default reads the checkpoint.
        controller = PlacementController(
            urls, TOKEN, min_replicas=K, min_tokens=10**12, watch_s=WATCH_S, weights_from="peer"
        )
        controller.start(NEVER_S)

        def drive():
            g = torch.Generator().manual_seed(4)
            step = 0
            while not stop.is_set():
                n = int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=g))
                ids = torch.randint(0, SPEC.num_experts, (n, TOPK), generator=g).to(torch.int32)
                x = torch.randn(n, SPEC.hidden, generator=g)
                w = torch.rand(n, TOPK, generator=g)
                layer = step % SPEC.num_layers
                try:
                    y = client.combine(client.dispatch(x, ids, w, layer))
                    torch.testing.assert_close(y, monolith(x, ids, w, layer), rtol=1e-5, atol=1e-6)
                except Exception as exc:  # reported below
                    errors.append(exc)
                    return
                done.append(time.monotonic())
                step += 1

        driver = threading.Thread(target=drive)
        driver.start()
        deadline = time.monotonic() + 60
        while len(done) < 20 and not errors:
            assert time.monotonic() < deadline, "the client never got going"
            time.sleep(0.02)
        procs[1].process.kill()  # SIGKILL: no goodbye to anyone
        killed = time.monotonic()
        survivors = [urls[0], urls[2]]
        while True:
            counts = copies(survivors)
            if all(min(c) >= K for c in counts.values()):
                break
            assert time.monotonic() - killed < RESTORE_DEADLINE_S, counts
            time.sleep(0.02)
        restored = time.monotonic() - killed
        # Requests keep completing on the restored placement.
        target = len(done) + 20
        while len(done) < target and not errors:
            assert time.monotonic() - killed < RESTORE_DEADLINE_S + 60, "requests stopped"
            time.sleep(0.02)
    finally:
        stop.set()
        if controller is not None:
            controller.stop()
        if "driver" in locals():
            driver.join(60)
        if client is not None:
            client.close()
        for p in procs:
            p.stop()
    assert not errors, errors
    restores = [r for r in controller.reports if r.trigger == "restore" and r.moves]
    assert restores, [r.to_dict() for r in controller.reports]
    r = restores[0]
    assert r.errors == [] and r.min_replicas == K and r.min_replicas_held == K, r.to_dict()
    # The killed server held 8 experts per layer, each with a copy on one survivor: the other
    # survivor pulls it from that peer.
    assert r.replicas_loaded == 16 and r.sources == {"peer": 16}, r.to_dict()
    assert not any(r.trigger == "interval" and r.moves for r in controller.reports)
    assert restored < RESTORE_DEADLINE_S


def test_too_few_servers_for_the_copies_is_said_and_the_most_are_placed():
    """min_replicas 3 over two servers: every expert goes on both, and the report says why not
    three. In-process servers with a real HTTP control plane."""
    experts = SPEC.experts()
    servers, https, urls = [], [], []
    try:
        for i, hosted in enumerate((range(0, 8), range(6, 12))):
            s = ExpertServer({0: {e: experts[0][e] for e in hosted}}, f"few{i}")
            s.start()
            servers.append(s)
            https.append(HttpServer(make_app(s)))
            urls.append(https[-1].start())
        controller = PlacementController(urls, "", min_replicas=3, min_tokens=10**12)
        report = controller.rebalance()
        assert report.trigger == "restore" and not report.errors, report.to_dict()
        assert report.min_replicas_held == 2
        assert "min_replicas=3 cannot hold" in report.redundancy_note
        assert "2 servers host them" in report.redundancy_note
        counts = {0: [0] * SPEC.num_experts}
        for url in urls:
            ids = httpx.get(f"{url}/experts", timeout=10).json()["layers"]["0"]
            for e in {e for e in ids if e >= 0}:
                counts[0][e] += 1
        assert counts[0] == [2] * SPEC.num_experts
        # Everything holds now: the next pass has nothing to restore.
        assert controller.rebalance().skipped
    finally:
        for h in https:
            h.stop()
        for s in servers:
            s.close()


def test_bad_min_replicas_is_refused():
    with pytest.raises(ValueError, match="min_replicas must be a positive integer"):
        PlacementController(["http://127.0.0.1:1"], min_replicas=0)
    with pytest.raises(ValueError, match="watch_s must be >= 0"):
        PlacementController(["http://127.0.0.1:1"], watch_s=-1)


def test_the_commands_take_min_replicas_and_refuse_a_bad_one():
    """`moecomm rebalance` and `moecomm frontend` share the option (default 2, said in --help);
    0 is refused with one line naming it, before anything connects."""
    cli = [sys.executable, "-m", "moecomm_serving.cli"]
    for command in ("rebalance", "frontend"):
        out = subprocess.run([*cli, command, "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "--min-replicas" in out.stdout, out.stderr
        assert "default 2" in " ".join(out.stdout.split())
    bad = subprocess.run(
        [*cli, "rebalance", "--servers", "http://127.0.0.1:1", "--min-replicas", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0
    assert "moecomm rebalance: --min-replicas must be >= 1, got 0" in bad.stdout + bad.stderr
