"""What must hold after a chaos trial: every surviving server's process and loop are alive and
answer right, and no shared-memory segment of the trial's processes is left behind."""

from __future__ import annotations

import re
import time

import httpx
import moecomm
import torch
from chaos_model import MAX_TOKENS, SPEC, TOPK, Reference
from moecomm.testing import connect_client

# A healthy server answers /health and a probe request in milliseconds; this long means its
# control plane or its loop is stuck.
HEALTH_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 3.0
# A server drops a dead client's session within its idle wake (0.1 s) or its next batch.
DEAD_CLIENT_GRACE_S = 3.0
HEALTH_POLL_S = 0.05
# Each layer is probed this many times in a row: the client's round-robin replica choice
# alternates, so two probes reach every replica of every expert, i.e. every server.
PROBE_ROUNDS = 2
_METRIC = re.compile(r"^moecomm_server_(requests|rejected)_total\{[^}]*\} (\d+)$", re.M)


def server_problems(name: str, process, url: str) -> tuple[list[str], dict]:
    """A surviving server once every client of the trial is gone: alive, /health 200, no
    client session left (killed clients dropped), and its counters (requests, rejected)."""
    if not process.is_alive():
        return [f"{name}: the process died (exit code {process.exitcode})"], {}
    deadline = time.monotonic() + DEAD_CLIENT_GRACE_S
    try:
        while True:
            r = httpx.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S)
            clients = r.json().get("clients", 0) if r.status_code == 200 else 0
            if not clients or time.monotonic() > deadline:
                break
            time.sleep(HEALTH_POLL_S)
        m = httpx.get(f"{url}/metrics", timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return [f"{name}: /health did not answer: {exc}"], {}
    problems = [] if r.status_code == 200 else [f"{name}: /health {r.status_code}: {r.text}"]
    if clients:
        problems.append(f"{name}: {clients} client sessions left after every client was gone")
    return problems, {k: int(v) for k, v in _METRIC.findall(m.text)}


def probe_batch(layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A full batch that routes to every expert of `layer`."""
    g = torch.Generator().manual_seed(1000 + layer)
    x = torch.randn(MAX_TOKENS, SPEC.hidden, generator=g)
    t = torch.arange(MAX_TOKENS)
    ids = torch.stack([(t + k) % SPEC.num_experts for k in range(TOPK)], dim=1).to(torch.int32)
    return x, ids, torch.rand(MAX_TOKENS, TOPK, generator=g)


def probe_problems(urls: list[str], client_id: int, reference: Reference) -> list[str]:
    """Sends every surviving server real work through a fresh client. A server whose loop died
    still answers /health; here it misses the deadline, which shows up as a failover."""
    problems = []
    client = None
    try:
        client = connect_client(
            urls, SPEC.hidden, TOPK, MAX_TOKENS, client_id, timeout=PROBE_TIMEOUT_S
        )
        for layer in range(SPEC.num_layers):
            x, ids, w = probe_batch(layer)
            (want,) = reference.layers[layer].forward([x], [ids], [w])
            for _ in range(PROBE_ROUNDS):
                y = client.combine(client.dispatch(x, ids, w, layer))
                if not torch.equal(y, want):
                    problems.append(f"probe layer {layer}: wrong result after the trial")
        if client.failovers:
            gone = sorted(client.urls[s] for s in client.evicted)
            problems.append(f"probe: servers {gone} did not answer in time (a dead loop?)")
    except Exception as exc:
        problems.append(f"probe: {type(exc).__name__}: {exc}")
    finally:
        if client is not None:
            client.close()
    return problems


def segment_problems(clean: dict[int, str], dead: dict[int, str]) -> list[str]:
    """`clean`: pid -> name of processes that exited on their own: they must have removed their
    segments themselves. `dead`: killed ones: whatever they left is reaped, then nothing of
    theirs may remain."""
    problems = []
    for pid, name in clean.items():
        left = moecomm.list_segments(pid)
        if left:
            problems.append(f"{name} (pid {pid}) exited cleanly but left segments {left}")
            moecomm.reap_stale_segments(pid)
    for pid, name in dead.items():
        moecomm.reap_stale_segments(pid)
        left = moecomm.list_segments(pid)
        if left:
            problems.append(f"{name} (pid {pid}): segments {left} survive reaping")
    return problems
