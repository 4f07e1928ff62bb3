"""Membership outages while serving (issue 28, deliverable 4): the embedded monitor killed -9,
or etcd stopped, in the middle of traffic, and brought back a few leases later.

What must hold: every request completes, bit-exact with the fault-free answer, on the last
membership each process knew; when the backend returns, every server and client is listed again
within a deadline (and a placement change made during the outage is published); nobody is
evicted because the backend was gone — no watcher hears a loss, no server drops a client, no
client drops, evicts or fails over from a server. Real processes throughout: the monitor or
etcd, two expert servers, a client process; the test process is a second client."""

from __future__ import annotations

import os
import secrets
import signal
import time

import httpx
import pytest
import torch
from membership_procs import STOP_TIMEOUT_S, EtcdProcess, MonitorProcess, etcd_binary
from moecomm.membership import connect_membership
from moecomm.runtime import AttentionClient, LayerExperts
from moecomm.runtime.launch import SERVING_TTL_S, ModelSpec, spawn_expert_server, spawn_ready
from moecomm.testing.clients import connect_client

SPEC = ModelSpec(num_layers=2, num_experts=4, hidden=32, intermediate=16, seed=28)
# Two experts per token: a sum of two terms is the same in either order, so any replica choice
# gives the bit-exact answer of the in-process reference.
TOPK = 2
MAX_TOKENS = 8
# Server 1 starts without expert 3 of layer 0 and loads it while the backend is down: the
# record it publishes then must reach the backend once it is back.
HOSTED = ({0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, {0: [0, 1, 2], 1: [0, 1, 2, 3]})
LOADED = (0, 3)
# The lease serving processes use (moecomm.runtime.launch): a shorter one makes leases lapse on
# this shared 2-core machine under load with no outage at all, which is not what is tested here.
TTL = SERVING_TTL_S
# The backend stays down this long: every lease would have expired twice over.
OUTAGE_S = 2 * TTL
# After the backend returns, traffic goes on this long: past the one-TTL re-registration grace
# of every watcher (moecomm.membership.watcher), so an eviction at its end would be seen.
AFTER_S = 2 * TTL
# Every member heartbeats three times per TTL, so it is back about TTL/3 after the backend is;
# one TTL plus scheduling slack for a loaded 2-core machine is the deadline.
BACK_WITHIN_S = TTL + 2.0
# A request's deadline: far above a healthy round trip, so a miss is a failure, not slowness.
REQUEST_TIMEOUT_S = 10.0
# The in-process client and the client process.
CLIENT_IDS = (2801, 2802)
# The client process's traffic before the test goes on: some fault-free requests.
WARM_REQUESTS = 20
POLL_S = 0.05
# Members' watchers read the backend at most this long per call, so closing them is quick.
WATCH_POLL_S = 0.3
HTTP_TIMEOUT_S = 10.0


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(x, topk_ids, topk_weights, layer) of request `step`: the same in every process."""
    g = torch.Generator().manual_seed(28_000 + step)
    n = int(torch.randint(1, MAX_TOKENS + 1, (), generator=g))
    x = torch.randn(n, SPEC.hidden, generator=g)
    ids = torch.rand(n, SPEC.num_experts, generator=g).argsort(dim=1)[:, :TOPK].to(torch.int32)
    return x, ids, torch.rand(n, TOPK, generator=g), step % SPEC.num_layers


class Reference:
    """The fault-free answers, computed in this process by the kernel the servers run."""

    def __init__(self):
        self.layers = {layer: LayerExperts(layer, e) for layer, e in SPEC.experts().items()}

    def __call__(self, step: int) -> torch.Tensor:
        x, ids, w, layer = make_batch(step)
        (y,) = self.layers[layer].forward([x], [ids], [w])
        return y.float()


def make_client(urls: list[str], client_id: int) -> AttentionClient:
    return connect_client(urls, SPEC.hidden, TOPK, MAX_TOKENS, client_id, timeout=REQUEST_TIMEOUT_S)


class Traffic:
    """Requests of one client, each checked against the reference; failures are collected,
    never raised, so a run reports all of them."""

    def __init__(self, client: AttentionClient, first_step: int):
        self.client = client
        self.reference = Reference()
        self.step = first_step
        self.done = 0
        self.problems: list[str] = []

    def check(self, step: int, handle_or_exc) -> None:
        self.done += 1
        try:
            y = self.client.combine(handle_or_exc)
        except Exception as exc:
            self.problems.append(f"request {step}: {type(exc).__name__}: {exc}")
            return
        if not torch.equal(y, self.reference(step)):
            self.problems.append(f"request {step}: output differs from the fault-free one")

    def one(self) -> None:
        step, self.step = self.step, self.step + 1
        x, ids, w, layer = make_batch(step)
        try:
            handle = self.client.dispatch(x, ids, w, layer)
        except Exception as exc:
            self.done += 1
            self.problems.append(f"request {step}: {type(exc).__name__}: {exc}")
            return
        self.check(step, handle)

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.one()

    def summary(self) -> dict:
        c = self.client
        return {
            "done": self.done,
            "problems": self.problems,
            "failovers": c.failovers,
            "reconnects": c.reconnects,
            "live": c.live_urls(),
        }


def _client_process(conn, urls: list[str], membership_url: str, token: str) -> None:
    """A second client in its own process: traffic from start to stop, then its summary."""
    torch.set_num_threads(1)
    client = make_client(urls, CLIENT_IDS[1])
    client.follow(connect_membership(membership_url, token, poll_s=WATCH_POLL_S), TTL)
    traffic = Traffic(client, first_step=1_000_000)
    for _ in range(WARM_REQUESTS):
        traffic.one()
    conn.send("ready")
    while not conn.poll():
        traffic.one()
    conn.recv()
    conn.send(traffic.summary())
    client.close()


class Store:
    """The membership backend under test, in its own process: taken down (the monitor by
    SIGKILL, etcd by SIGTERM) and brought back in place (same port; etcd on its data dir or,
    with `fresh`, an empty one)."""

    def __init__(self, kind: str, workdir: str):
        self.kind = kind
        self.fresh = kind == "etcd-fresh"
        if kind == "embedded":
            self.token = "tok-" + secrets.token_hex(8)
            self.proc = MonitorProcess(token=self.token)
            self.url = self.proc.start()
        else:
            self.token = ""
            self.proc = EtcdProcess(etcd_binary(), workdir)
            self.proc.start()
            self.url = f"etcd://{self.proc.endpoint}/outage"

    def take_down(self) -> None:
        if self.kind == "embedded":
            os.kill(self.proc.proc.pid, signal.SIGKILL)
            self.proc.proc.wait(STOP_TIMEOUT_S)
        else:
            self.proc.stop()

    def bring_back(self) -> None:
        # The monitor keeps nothing, so it always comes back empty; etcd on its data dir keeps
        # its leases (and refreshes them when it elects itself leader).
        self.proc.restart(fresh=self.fresh)

    def close(self) -> None:
        self.proc.stop()


@pytest.fixture(params=["embedded", "etcd", "etcd-fresh"])
def store(request, tmp_path):
    if request.param != "embedded":
        try:
            etcd_binary()
        except (RuntimeError, OSError) as exc:
            pytest.fail(f"the etcd outage test needs etcd (make etcd): {exc}")
    s = Store(request.param, str(tmp_path))
    yield s
    s.close()


def wait_until(what: str, predicate, timeout: float) -> float:
    """Seconds until `predicate()` held; fails naming `what` after `timeout`."""
    start = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except ConnectionError:
            pass  # the backend is still coming up
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what} not within {timeout} s")
        time.sleep(POLL_S)


def members(ms) -> set[tuple[str, str]]:
    return {m.key for m in ms.list_members()}


def hosted_by(ms, server_id: str) -> dict:
    return next(m.experts for m in ms.list_members("server") if m.member_id == server_id)


@pytest.mark.timeout(300)
def test_backend_outage_loses_no_request_and_evicts_nobody(store, reaper):
    ids = [f"outage-{store.kind}-{i}" for i in range(len(HOSTED))]
    servers = [
        reaper.server(
            spawn_expert_server(
                SPEC,
                hosted,
                sid,
                monitor_url=store.url,
                ttl=TTL,
                monitor_token=store.token,
            )
        )
        for sid, hosted in zip(ids, HOSTED, strict=True)
    ]
    urls = [s.url for s in servers]
    ms = connect_membership(store.url, store.token, poll_s=WATCH_POLL_S)
    events = []  # (seconds since the test began, event): a failure shows when each came
    t0 = time.monotonic()
    observer = ms.watch(callback=lambda e: events.append((round(time.monotonic() - t0, 2), e)))
    client = None
    try:
        client = make_client(urls, CLIENT_IDS[0])
        client.follow(ms, TTL)
        traffic = Traffic(client, first_step=0)
        proc, conn, ready = spawn_ready(
            _client_process, (urls, store.url, store.token), "client process"
        )
        reaper.process(proc)
        assert ready == "ready"
        everyone = {("server", sid) for sid in ids} | {("client", str(c)) for c in CLIENT_IDS}
        wait_until("every member registered", lambda: everyone <= members(ms), BACK_WITHIN_S)
        traffic.run_for(TTL)  # fault-free, with every member registered

        # Down in the middle of a request: dispatched before, combined after.
        step = traffic.step
        traffic.step += 1
        handle = client.dispatch(*make_batch(step))
        store.take_down()
        down_at = round(time.monotonic() - t0, 2)
        traffic.check(step, handle)
        with pytest.raises(ConnectionError):
            ms.list_members()  # the outage is real
        # A placement change while the backend is down: served at once, published on return.
        r = httpx.post(
            f"{urls[1]}/experts/load",
            json={"layer": LOADED[0], "expert": LOADED[1]},
            timeout=HTTP_TIMEOUT_S,
        )
        assert r.status_code == 200, r.text
        before = traffic.done
        traffic.run_for(OUTAGE_S)
        assert traffic.done > before, "no request was served during the outage"

        store.bring_back()
        back_at = round(time.monotonic() - t0, 2)
        back_s = wait_until("every member back", lambda: everyone <= members(ms), BACK_WITHIN_S)
        wait_until(
            "the placement change published",
            lambda: LOADED[1] in hosted_by(ms, ids[1]).get(LOADED[0], []),
            BACK_WITHIN_S,
        )
        traffic.run_for(AFTER_S)
        timeline = [(t, e.kind, e.reason, e.member.key) for t, e in events]
        losses = [x for x in timeline if x[1] == "loss"]
        assert not losses, f"down at {down_at} s, back at {back_at} s; events: {timeline}"
        # Before any client leaves: both servers still hold both clients' sessions.
        for url in urls:
            health = httpx.get(f"{url}/health", timeout=HTTP_TIMEOUT_S).json()
            assert health["clients"] == len(CLIENT_IDS), (url, health)

        conn.send("stop")
        assert conn.poll(REQUEST_TIMEOUT_S * 2), "the client process did not report"
        other = conn.recv()
        mine = traffic.summary()
        for name, got in (("in-process client", mine), ("client process", other)):
            assert got["done"] > 0, name
            assert got["problems"] == [], (name, got["problems"][:5])
            assert (got["failovers"], got["reconnects"]) == (0, 0), (name, got)
            assert sorted(got["live"]) == sorted(urls), (name, got)
        print(
            f"{store.kind}: {mine['done']} + {other['done']} requests, 0 lost; "
            f"every member back {back_s:.2f} s after the backend"
        )
    finally:
        observer.close()
        if client is not None:
            client.close()
        ms.close()
