"""Front ends lost under a router while requests stream (two prefill and two decode front ends):
a killed prefill front end, a killed decode front end (its requests are replayed) and a stopped
one (SIGSTOP: its requests are replayed after the backend timeout). Every request completes
with exactly the tokens it gets without the fault, within its deadline; the lost front end is
restarted on its port afterwards and the router takes it back."""

from __future__ import annotations

import signal
import socket
import time

import httpx
import pytest
from moecomm.testing import FrontendSpec, start_local_cluster
from moecomm_serving.model.tiny import write_tiny
from pd_procs import HTTP_TIMEOUT_S, MODEL_NAME, Deployment, Stream, metric
from proc_helpers import stop_process

# Long enough that every stream is still running when the fault strikes (the tiny model makes
# a token in milliseconds, but a stream of this length takes a good fraction of a second).
MAX_TOKENS = 64
# Greedy and seeded-sampled requests: a replay must reproduce both.
REQUESTS = [
    ("The experts are", {}),
    ("Once upon a time", {"temperature": 0.8, "seed": 7}),
    (list(range(5, 45)), {}),
    ("moecomm moves tokens", {"temperature": 1.0, "top_p": 0.9, "seed": 99}),
]
# The router's patience with a silent front end: a stopped one costs this much, then a replay.
BACKEND_TIMEOUT_S = 3.0
# Every request's deadline at the router (retries included); the test checks it is kept.
REQUEST_TIMEOUT_S = 60.0
# Streams must have shown this many tokens before the fault: the fault is mid-stream.
TOKENS_BEFORE_FAULT = 2
WAIT_S = 90.0  # for streams to start, end, and for the router to take a front end back
POLL_S = 0.1


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:  # held together: n distinct ports
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _run(url: str, requests=REQUESTS) -> list[Stream]:
    return [
        Stream(url, prompt, MAX_TOKENS, ignore_eos=True, **params) for prompt, params in requests
    ]


def _results(streams: list[Stream], deadline: float) -> list[list[int]]:
    return [s.result(deadline) for s in streams]


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """Two prefill and two decode front ends on fixed ports (a restarted one gets its URL
    back), the router, and every request's tokens without a fault. Yields (router URL,
    Deployment, baseline)."""
    tmp = tmp_path_factory.mktemp("pd-faults")
    ckpt = tmp / "tiny"
    write_tiny(str(ckpt), "mixtral", seed=0)
    dep = Deployment(tmp)
    try:
        ports = _free_ports(4)
        roles = ["prefill", "prefill", "decode", "decode"]
        names = ["prefill0", "prefill1", "decode0", "decode1"]
        # in-process experts (no servers), each on a fixed port (the later --port wins)
        specs = [
            FrontendSpec(role, ("--port", str(port)), name)
            for name, role, port in zip(names, roles, ports, strict=True)
        ]
        timeouts = ("--backend-timeout", str(BACKEND_TIMEOUT_S))
        timeouts += ("--request-timeout", str(REQUEST_TIMEOUT_S))
        timeouts += ("--max-local-prefill-tokens", "0")  # every request split: its faults
        cluster = start_local_cluster(
            ckpt, frontends=specs, router=timeouts, model_name=MODEL_NAME, procs=dep.processes
        )
        router = cluster.router_url
        baseline = _results(_run(router), time.monotonic() + WAIT_S)
        assert all(len(t) == MAX_TOKENS for t in baseline)
        yield router, dep, baseline
    finally:
        dep.stop_all()


def _retries(router: str, phase: str) -> float:
    return metric(router, f'moecomm_router_retries_total{{phase="{phase}"}}')


def _wait_all_healthy(router: str, deadline: float) -> None:
    """Until the router's /health lists every front end healthy (a restarted one is probed back)."""
    body = {}
    while time.monotonic() < deadline:
        body = httpx.get(f"{router}/health", timeout=HTTP_TIMEOUT_S).json()
        if body.get("status") == "ok" and all(
            b["healthy"] for role in ("prefill", "decode") for b in body[role]
        ):
            return
        time.sleep(POLL_S)
    raise AssertionError(f"the router did not take every front end back: {body}")


def _restore(router: str, dep: Deployment, name: str) -> None:
    dep.restart(name)
    _wait_all_healthy(router, time.monotonic() + WAIT_S)


def _mid_stream(streams: list[Stream]) -> None:
    deadline = time.monotonic() + WAIT_S
    for s in streams:
        s.wait_tokens(TOKENS_BEFORE_FAULT, deadline)


@pytest.mark.timeout(180)
def test_a_killed_prefill_front_end_loses_no_request(split):
    router, dep, baseline = split
    before = _retries(router, "prefill")
    streaming = _run(router)
    _mid_stream(streaming)
    dep.kill("prefill0")
    # the router learns of the loss from the requests that meet it: round robin sends one of
    # these to the dead front end
    after = _run(router)
    deadline = time.monotonic() + WAIT_S
    assert _results(streaming, deadline) == baseline
    assert _results(after, deadline) == baseline
    assert _retries(router, "prefill") > before
    _restore(router, dep, "prefill0")


@pytest.mark.timeout(180)
def test_a_killed_decode_front_end_mid_stream_is_replayed(split):
    router, dep, baseline = split
    before = _retries(router, "decode")
    streams = _run(router)
    _mid_stream(streams)
    dep.kill("decode0")
    assert _results(streams, time.monotonic() + WAIT_S) == baseline
    assert _retries(router, "decode") > before  # some streams were on it: replayed
    assert _results(_run(router), time.monotonic() + WAIT_S) == baseline
    _restore(router, dep, "decode0")


@pytest.mark.timeout(180)
def test_a_stopped_decode_front_end_costs_a_timeout_not_the_requests(split):
    router, dep, baseline = split
    before = _retries(router, "decode")
    streams = _run(router)
    t0 = time.monotonic()
    _mid_stream(streams)
    stop_process(dep.procs["decode1"].pid)
    try:
        assert _results(streams, t0 + REQUEST_TIMEOUT_S) == baseline
        assert time.monotonic() - t0 < REQUEST_TIMEOUT_S
        assert _retries(router, "decode") > before
        # new requests keep off the stopped front end
        assert _results(_run(router), time.monotonic() + WAIT_S) == baseline
    finally:
        dep.signal("decode1", signal.SIGCONT)
    _wait_all_healthy(router, time.monotonic() + WAIT_S)
