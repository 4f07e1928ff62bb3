"""The placement controller's redundancy watch is notified, not polling: an idle controller
reads the servers' tables (GET /experts, counted by each server's /metrics) only on its first
pass and its slow safety poll, yet a server killed with SIGKILL is still re-homed at once
(its idle watch connection closes and a new one is refused); notified=False is the old watch
that reads every table every watch_s."""

import re
import time

import httpx
import pytest
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.runtime.placement import PlacementController

SPEC = ModelSpec(num_layers=1, num_experts=12, hidden=32, intermediate=16, seed=5)
TOKEN = "t0ken"
K = 2
# Three servers, every expert on two of them.
HOSTED = [{0: [(4 * i + j) % 12 for j in range(8)]} for i in range(3)]
# The watch looks at its events this often (the old watch read every table this often).
WATCH_S = 0.05
# How long the idle controller is watched: the old watch makes IDLE_S / WATCH_S = 60 reads of
# each table in it.
IDLE_S = 3.0
# Reads of each table the notified watch may make in IDLE_S: its first pass, and one more for a
# safety poll or a connection the server's HTTP stack closed while idle.
MAX_IDLE_READS = 2
# Far past the test: a loss must be found by the watch's connection, not by its safety poll.
NO_SAFETY_POLL_S = 3600.0
# A restore on this 2-core machine takes well under a second (bench/recovery/redundancy.py);
# room for a loaded machine.
LOSS_DEADLINE_S = 20.0
# No load-driven pass may run during the test: only the watch acts.
NEVER_S = 3600.0


def table_reads(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r"^moecomm_server_table_reads_total\{[^}]*\} (\d+)$", text, re.M)
    assert m, text
    return int(m.group(1))


def copies(urls: list[str]) -> list[int]:
    out = [0] * SPEC.num_experts
    for url in urls:
        ids = httpx.get(f"{url}/experts", params={"load": "false"}, timeout=10).json()["layers"]
        for e in {e for e in ids["0"] if e >= 0}:
            out[e] += 1
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("notified", [True, False])
def test_an_idle_watch_reads_tables_only_on_events_and_still_restores_a_kill_9(notified):
    procs = []
    controller = None
    try:
        procs = [spawn_expert_server(SPEC, h, f"pw{i}", TOKEN) for i, h in enumerate(HOSTED)]
        urls = [p.url for p in procs]
        before = [table_reads(u) for u in urls]
        controller = PlacementController(
            urls,
            TOKEN,
            min_replicas=K,
            min_tokens=10**12,
            watch_s=WATCH_S,
            notified=notified,
            safety_poll_s=NO_SAFETY_POLL_S,
        )
        controller.start(NEVER_S)
        time.sleep(IDLE_S)
        reads = [table_reads(u) - b for u, b in zip(urls, before, strict=True)]
        if notified:
            assert max(reads) <= MAX_IDLE_READS, reads
        else:  # the old watch: a read of every table every tick
            assert min(reads) >= IDLE_S / WATCH_S / 4, reads
        procs[1].process.kill()  # SIGKILL: no goodbye
        killed = time.monotonic()
        survivors = [urls[0], urls[2]]
        while min(copies(survivors)) < K:
            assert time.monotonic() - killed < LOSS_DEADLINE_S, copies(survivors)
            time.sleep(0.05)
    finally:
        if controller is not None:
            controller.stop()
        for p in procs:
            p.stop()
    restores = [r for r in controller.reports if r.trigger == "restore" and r.moves]
    assert restores and not restores[0].errors, [r.to_dict() for r in controller.reports]
    assert restores[0].replicas_loaded == 8, restores[0].to_dict()


def test_a_bad_safety_poll_is_refused():
    with pytest.raises(ValueError, match="safety_poll_s must be > 0"):
        PlacementController(["http://127.0.0.1:1"], safety_poll_s=0)
