"""Expert servers as processes: each one builds its experts from a seed (weights never cross a
pipe), starts its loop and its HTTP control plane on 127.0.0.1, and reports its URL."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
from dataclasses import dataclass

import torch

from moecomm import prefork
from moecomm.errors import DeadlineExceededError
from moecomm.http_thread import HttpServer
from moecomm.runtime.control import make_app
from moecomm.runtime.experts import random_experts
from moecomm.runtime.server import ExpertServer

STOP = "stop"
# Lease of the serving processes (expert servers, front ends) registered with a membership: a lost
# server is heard about this late at most. Shorter than the membership library's general default
# (moecomm.membership.DEFAULT_TTL_S, 5 s): serving wants a lost server out of the rotation fast.
SERVING_TTL_S = 2.0
# A spawned server process is up: a fresh interpreter imports torch, builds its experts and
# warms up, on a busy machine.
SERVER_START_TIMEOUT_S = 120.0
# How often a server process checks for a stop request or a failed loop.
SUPERVISE_S = 0.2
# Exit status of a server process whose serving loop failed (a supervisor restarts it).
LOOP_FAILED_EXIT = 3


@dataclass(frozen=True)
class ModelSpec:
    """Deterministic random expert weights shared by every process of a test or benchmark."""

    num_layers: int
    num_experts: int
    hidden: int
    intermediate: int
    seed: int = 0
    dtype: str = "float32"

    def experts(self):
        return random_experts(
            self.num_layers,
            self.num_experts,
            self.hidden,
            self.intermediate,
            self.seed,
            getattr(torch, self.dtype),
        )


def _serve(
    conn,
    spec: ModelSpec,
    hosted: dict,
    server_id: str,
    token: str,
    batching_window_s: float,
    monitor_url: str | None,
    monitor_token: str,
    ttl: float,
    transport: str = "shm",
) -> None:
    torch.set_num_threads(1)
    all_experts = spec.experts()
    experts = {layer: {e: all_experts[layer][e] for e in ids} for layer, ids in hosted.items()}
    server = ExpertServer(
        experts,
        server_id,
        batching_window_s=batching_window_s,
        # The seed is this process's checkpoint: any expert can be loaded later.
        weight_source=lambda layer, e: all_experts[layer][e],
        transport=transport,
    )
    http = HttpServer(make_app(server, token))
    server.start()
    url = http.start()
    if monitor_url:
        from moecomm.membership import connect_membership

        server.join_membership(connect_membership(monitor_url, monitor_token), url, ttl)
    conn.send(url)
    wait_for_stop(conn, server)
    http.stop()
    server.close()
    if not server.health.ok:
        sys.exit(LOOP_FAILED_EXIT)


def wait_for_stop(conn, server: ExpertServer) -> None:
    """In a server process: returns when the parent says stop (or dies: EOF on `conn`), or when
    the serving loop fails; the caller then exits non-zero (LOOP_FAILED_EXIT), as `moecomm
    expert-server` does, so whoever supervises the process sees it."""
    while not server.health.failed.wait(SUPERVISE_S):
        with contextlib.suppress(EOFError, OSError):
            if not conn.poll():
                continue
        break


@dataclass
class ServerProcess:
    process: mp.Process
    conn: object
    url: str
    server_id: str

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send(STOP)
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()  # a forked one may be reaped already
            self.process.join(timeout)


def spawn_expert_server(
    spec: ModelSpec,
    hosted: dict[int, list[int]],
    server_id: str,
    token: str = "",
    batching_window_s: float = 0.0,
    monitor_url: str | None = None,
    ttl: float = SERVING_TTL_S,
    monitor_token: str = "",
    transport: str = "shm",
) -> ServerProcess:
    args = (
        spec,
        hosted,
        server_id,
        token,
        batching_window_s,
        monitor_url,
        monitor_token,
        ttl,
        transport,
    )
    return start_server_process(_serve, args, server_id)


def start_server_process(target, args: tuple, server_id: str) -> ServerProcess:
    """Spawns a server process running `target(conn, *args)` and waits for the control-plane
    URL it sends on `conn` once it serves (see wait_for_stop for the rest of the protocol)."""
    p, conn, url = spawn_ready(target, args, f"expert server {server_id}")
    return ServerProcess(p, conn, url, server_id)


def spawn_ready(target, args: tuple, what: str, timeout: float = SERVER_START_TIMEOUT_S):
    """Starts a process running `target(conn, *args)` (a fresh one; forked from the preloaded
    server where tests enabled :mod:`moecomm.prefork`) and waits up to `timeout` for the
    first message it sends on `conn`, its sign that it serves. Returns (process, conn,
    message); `what` names the process in the error when it does not start."""
    ctx = prefork.process_context()  # "spawn", or the preloaded fork server in tests
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child, *args), daemon=True)
    p.start()
    child.close()
    if not parent.poll(timeout):
        p.kill()
        p.join()
        raise DeadlineExceededError(f"{what} did not start in {timeout} s")
    try:
        message = parent.recv()
    except EOFError:
        p.join(timeout)
        raise RuntimeError(f"{what} exited during start-up (exit code {p.exitcode})") from None
    return p, parent, message
