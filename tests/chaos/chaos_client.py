"""One client process of a chaos trial: an AttentionClient with two micro-batches in flight,
batches of 0 ... MAX_TOKENS tokens, combined in a random order, over one or more
connect ... disconnect runs. Everything it sees goes back to the test over its pipe, one message
per request, so a kill loses only what was still in flight."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import httpx
import torch
from chaos_model import MAX_TOKENS, SPEC, TOPK, BatchKey, make_batch, rng_seed
from moecomm.errors import MoecommError
from moecomm.runtime import AttentionClient
from moecomm.testing import connect_client

# Connect attempts before a run gives up: each retry leaves out servers that did not answer
# /health, so a dead or stopped server costs one attempt.
CONNECT_ATTEMPTS = 4
# A live server answers /health in milliseconds; a stopped one never does.
HEALTH_PROBE_S = 0.5
# Micro-batches in flight: double-batch overlap.
IN_FLIGHT = 2
# Share of steps that follow the previous one at once (a decode loop whose attention overlaps
# the experts): the next request lands in a slot the server has only just answered, the timing
# that killed server loops reading a released slot (issue 13).
BACK_TO_BACK_SHARE = 0.75
# What the test sends a standby process to start it.
GO = "go"


@dataclass(frozen=True)
class ClientJob:
    """What one client process does: `runs[r]` steps in run r, against `urls`."""

    seed: int
    client_id: int
    generation: int
    urls: tuple[str, ...]
    runs: tuple[int, ...]
    timeout_s: float
    evict_s: float
    # Emulated attention compute between steps: spreads the clients' requests over time.
    think_s: float


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=HEALTH_PROBE_S).status_code == 200
    except httpx.HTTPError:
        return False


def connect_live(job: ClientJob) -> tuple[AttentionClient, int]:
    """Connects as a user would; returns the client and the attempts it took. connect()
    leaves out servers it cannot reach; one that fails anyway (a server killed mid-handshake)
    is retried without the servers that do not answer /health."""
    urls = list(job.urls)
    error: Exception | None = None
    for attempt in range(1, CONNECT_ATTEMPTS + 1):
        try:
            client = connect_client(
                urls,
                SPEC.hidden,
                TOPK,
                MAX_TOKENS,
                job.client_id,
                timeout=job.timeout_s,
                evict_s=job.evict_s,
            )
            return client, attempt
        except (ConnectionError, MoecommError) as exc:
            error = exc
            urls = [u for u in job.urls if _answers(u)] or list(job.urls)
    raise ConnectionError(f"no connect in {CONNECT_ATTEMPTS} attempts: {error}")


@dataclass(frozen=True)
class Timing:
    """When one request was dispatched and combined (CLOCK_MONOTONIC, comparable with the
    test's fault times), how long its thread waited for a CPU in between, and when its combine
    evicted a server (url -> time): what a slow reroute is made of."""

    sent: float
    done: float
    runqueue_s: float | None
    evicted_at: dict


def _newly_evicted(client: AttentionClient, before: dict) -> list[str]:
    return [client.urls[s] for s, until in client.evicted.items() if before.get(s) != until]


def _evicted_at(client: AttentionClient, before: dict) -> dict:
    """An eviction sets `evicted[s]` to its own time plus evict_s: its time is read back."""
    return {
        client.urls[s]: until - client.evict_s
        for s, until in client.evicted.items()
        if before.get(s) != until
    }


def _runqueue_s() -> float | None:
    """Seconds this thread has waited for a CPU so far (/proc schedstat, field 2): a reroute
    that is slow because its client was not scheduled shows here, not in the library. None
    where the kernel keeps no schedstat (CONFIG_SCHED_INFO off)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _step(client: AttentionClient, keys: list[BatchKey], rng: random.Random, send) -> None:
    handles = []
    for key in keys:
        x, ids, w, layer = make_batch(key)
        try:
            sent = (time.monotonic(), _runqueue_s())
            handles.append((key, sent, client.dispatch(x, ids, w, layer)))
        except Exception as exc:  # reported, and this micro-batch is lost
            send(("error", key.as_tuple(), "dispatch", f"{type(exc).__name__}: {exc}"))
    rng.shuffle(handles)  # combine A then B, or B then A
    for key, (sent_at, runq_at), handle in handles:
        failovers, evicted = client.failovers, dict(client.evicted)
        try:
            y = client.combine(handle)
        except Exception as exc:
            send(("error", key.as_tuple(), "combine", f"{type(exc).__name__}: {exc}"))
            continue
        done = time.monotonic()  # CLOCK_MONOTONIC: comparable with the test's kill times
        if tuple(y.shape) != (handle.num_tokens, SPEC.hidden) or y.dtype != torch.float32:
            got = f"{tuple(y.shape)} {y.dtype} for {handle.num_tokens} tokens"
            send(("error", key.as_tuple(), "combine", f"combined to {got}"))
            continue
        moved = client.failovers - failovers
        runq = _runqueue_s()
        waited = None if runq is None or runq_at is None else runq - runq_at
        timing = Timing(sent_at, done, waited, _evicted_at(client, evicted))
        send(("done", key.as_tuple(), timing, moved, _newly_evicted(client, evicted), _bytes(y)))


def _bytes(y: torch.Tensor) -> bytes:
    return y.contiguous().numpy().tobytes()


def client_main(conn, job: ClientJob) -> None:
    """Process entry point. Never raises: failures are reported, then the process exits."""
    torch.set_num_threads(1)
    rng = random.Random(rng_seed("client", job.seed, job.client_id, job.generation))

    def send(msg) -> None:
        conn.send(msg)

    # Imported and ready: wait as a standby until the process this one replaces is gone.
    send(("ready", job.generation))
    try:
        if conn.recv() != GO:
            return
    except EOFError:  # the test is gone
        return
    try:
        for run, steps in enumerate(job.runs):
            try:
                client, attempts = connect_live(job)
            except Exception as exc:
                send(("error", None, "connect", f"run {run}: {type(exc).__name__}: {exc}"))
                continue
            send(("connect", job.generation, run, attempts, len(client.urls)))
            try:
                for step in range(steps):
                    keys = [
                        BatchKey(job.seed, job.client_id, job.generation, run, step, micro)
                        for micro in range(IN_FLIGHT)
                    ]
                    _step(client, keys, rng, send)
                    if rng.random() >= BACK_TO_BACK_SHARE:
                        time.sleep(rng.uniform(0.0, job.think_s))
            finally:
                client.close()
        send(("exit", job.generation))
    except Exception as exc:  # a bug of the harness or the library: make it visible
        send(("error", None, "client", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()
