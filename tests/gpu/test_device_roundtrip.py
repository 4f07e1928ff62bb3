"""The GPU path end to end: `moecomm expert-server --device cuda` processes, a DeviceClient in
this process, CUDA IPC between them on one GPU (stage `core` of `make gpu-check`; the
sanitizer runs on the one-process loopback test, test_smoke_loopback.py, instead).

Attacks timing the way production does: a new token count every step, slots reused the
instant they are released, a server stopped (SIGSTOP) until the client's deadline passes and the
same slot then reused on a replica, a server killed mid-run, a drained server, a step captured
in a CUDA graph and replayed with new inputs. Every answer is checked against a reference
computed here from the same seeded weights.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

LAYERS, EXPERTS, HIDDEN, INTER, SEED = 2, 8, 256, 128, 3
SPEC = f"layers={LAYERS},experts={EXPERTS},hidden={HIDDEN},intermediate={INTER},seed={SEED}"
TOPK, MAX_TOKENS = 4, 64
# Steps of the sizes test (MOECOMM_ROUNDTRIP_STEPS: fewer for a quick look, more for a soak).
STEPS = int(os.environ.get("MOECOMM_ROUNDTRIP_STEPS", "40"))
CLI = [sys.executable, "-m", "moecomm_serving.cli"]
START_TIMEOUT_S = 180


class Servers:
    """GPU expert server processes; all of them stopped and reaped at the end, pass or fail."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, experts: str, encoding: str = "bf16") -> tuple[str, subprocess.Popen]:
        argv = [*CLI, "expert-server", "--device", "cuda", "--random-experts", SPEC,
                "--experts", experts, "--max-tokens", str(MAX_TOKENS), "--topk", str(TOPK),
                "--encoding", encoding, "--port", "0"]  # fmt: skip
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # fmt: skip
        self.procs.append(p)
        deadline = time.monotonic() + START_TIMEOUT_S
        lines = []
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if " listening on " in line:
                return line.split(" listening on ")[1].split(": layers")[0], p
        p.kill()
        raise RuntimeError("GPU expert server did not start:\n" + "".join(lines))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with_suppress(os.killpg, p.pid, signal.SIGCONT)
                with_suppress(os.killpg, p.pid, signal.SIGKILL)
            p.wait(30)


def with_suppress(fn, *args) -> None:
    with contextlib.suppress(OSError):
        fn(*args)


@pytest.fixture
def servers():
    s = Servers()
    try:
        yield s
    finally:
        s.close()


def reference(x, ids, w) -> torch.Tensor:
    """y[t] = Σ_k w[t,k] · expert(x[t]) in f32 from the servers' seeded weights (bf16)."""
    from moecomm.runtime import random_experts

    experts = random_experts(LAYERS, EXPERTS, HIDDEN, INTER, seed=SEED, dtype=torch.bfloat16)[0]
    xf = x.float().cpu()
    y = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            ew = experts[e]
            h = torch.nn.functional.silu(ew.w1.float() @ xf[t]) * (ew.w3.float() @ xf[t])
            y[t] += float(w[t, k]) * (ew.w2.float() @ h)
    return y


def inputs(g: torch.Generator, n: int):
    x = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(n)]).int()
    w = torch.rand(n, TOPK, generator=g)
    return x, ids, w


def check(client, x, ids, w, layer=0):
    dev = client.device
    h = client.dispatch(x.to(dev), ids.to(dev), w.to(dev), layer)
    y = client.combine(h).float().cpu()
    torch.testing.assert_close(y, reference(x, ids, w), rtol=3e-2, atol=3e-2)


def connect(urls, **kw):
    from moecomm.runtime import DeviceClient

    return DeviceClient.from_servers(urls, device="cuda:0", **kw)


def test_sizes_change_every_step_and_slots_are_reused_at_once(servers):
    a, _ = servers.start("0-3")
    b, _ = servers.start("4-7")
    client = connect([a, b], timeout=5.0)
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(STEPS):
            n = 1 + (step * 7) % MAX_TOKENS
            check(client, *inputs(g, n), layer=step % LAYERS)
        # Two steps in flight on the two slots, combined out of order.
        xs = [inputs(g, 5 + i) for i in range(2)]
        dev = client.device
        hs = [client.dispatch(x.to(dev), i.to(dev), w.to(dev), 0) for x, i, w in xs]
        for h, (x, ids, w) in reversed(list(zip(hs, xs, strict=True))):
            torch.testing.assert_close(
                client.combine(h).float().cpu(), reference(x, ids, w), rtol=3e-2, atol=3e-2
            )
    finally:
        client.close()


def test_fp8_requests_are_served_through_the_scaled_grouped_gemm(servers):
    url, _ = servers.start("0-7", encoding="fp8_e4m3_b128")
    client = connect([url], timeout=5.0)
    g = torch.Generator().manual_seed(1)
    try:
        for n in (1, 17, MAX_TOKENS):
            x, ids, w = inputs(g, n)
            dev = client.device
            y = client.combine(client.dispatch(x.to(dev), ids.to(dev), w.to(dev), 1)).float()
            ref = reference(x, ids, w)
            rel = (y.cpu() - ref).norm() / ref.norm()
            assert rel < 0.08, f"fp8 round trip differs by {rel:.3f} (relative)"
    finally:
        client.close()


def test_a_stopped_server_times_out_and_the_same_slot_is_reused_on_its_replica(servers):
    a, pa = servers.start("0-7")
    b, _ = servers.start("0-7")
    client = connect([a, b], timeout=0.5)
    g = torch.Generator().manual_seed(2)
    try:
        check(client, *inputs(g, 8))
        os.killpg(pa.pid, signal.SIGSTOP)  # A still maps our memory, answers nothing
        for _ in range(6):  # the first step evicts A after its deadline, every step is right
            check(client, *inputs(g, 9))
        os.killpg(pa.pid, signal.SIGCONT)  # A's late answer lands in a ring no longer read
        for _ in range(4):
            check(client, *inputs(g, 3))
        assert len(client.servers) == 1
        client.add_server(a)  # a fresh ring: A serves again, its late bytes count for nothing
        for _ in range(6):
            check(client, *inputs(g, 11))
    finally:
        client.close()


def test_a_killed_server_fails_over_without_a_wrong_answer(servers):
    a, _ = servers.start("0-7")
    b, pb = servers.start("0-7")
    client = connect([a, b], timeout=2.0)
    g = torch.Generator().manual_seed(3)
    try:
        for step in range(30):
            if step == 7:
                os.killpg(pb.pid, signal.SIGKILL)
            check(client, *inputs(g, 1 + step % 13))
    finally:
        client.close()


def test_a_draining_server_answers_draining_and_its_replica_serves(servers):
    import httpx
    from moecomm.runtime import DeviceStepFailedError

    a, _ = servers.start("0-7")
    b, _ = servers.start("0-7")
    client = connect([a, b], timeout=2.0)
    g = torch.Generator().manual_seed(4)
    try:
        httpx.post(f"{a}/drain", json={"token": ""}, timeout=10).raise_for_status()
        for _ in range(5):
            check(client, *inputs(g, 6))
        httpx.post(f"{b}/drain", json={"token": ""}, timeout=10).raise_for_status()
        with pytest.raises(DeviceStepFailedError, match="no live server"):
            check(client, *inputs(g, 6))
    finally:
        client.close()


def test_a_step_captured_in_a_cuda_graph_replays_with_new_inputs(servers):
    url, _ = servers.start("0-7")
    client = connect([url], timeout=5.0)
    g = torch.Generator().manual_seed(5)
    n, dev = 16, torch.device("cuda:0")
    x = torch.zeros(n, HIDDEN, dtype=torch.bfloat16, device=dev)
    ids = torch.zeros(n, TOPK, dtype=torch.int32, device=dev)
    w = torch.zeros(n, TOPK, device=dev)
    out = torch.empty(n, HIDDEN, dtype=torch.bfloat16, device=dev)
    try:
        check(client, *inputs(g, n))  # warm: Triton compiled, maps built
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            client.launch(x, ids, w, 0, slot=0)
            client.wait(n, 0, 0, out)
        for _ in range(5):
            xi, ii, wi = inputs(g, n)
            x.copy_(xi)
            ids.copy_(ii)
            w.copy_(wi)
            graph.replay()
            torch.cuda.synchronize(dev)
            status, _ = client.status(0)
            assert set(status.tolist()) <= {0, 3}, status  # OK or NOT_SENT
            torch.testing.assert_close(out.float().cpu(), reference(xi, ii, wi), rtol=3e-2,
                                       atol=3e-2)  # fmt: skip
    finally:
        client.close()


def test_host_and_gpu_peers_refuse_each_other_naming_the_fix(servers):
    from moecomm.errors import MoecommError
    from moecomm.runtime import AttentionClient, ExpertServer, random_experts
    from moecomm.runtime.control import HttpServer, make_app

    gpu_url, _ = servers.start("0-7")
    host = ExpertServer(random_experts(1, 2, HIDDEN, INTER), "host", transport="shm")
    http = HttpServer(make_app(host))
    host_url = http.start()
    try:
        with pytest.raises(MoecommError, match="--device cuda"):
            connect([host_url])
        client = AttentionClient([gpu_url], 1, HIDDEN, TOPK, MAX_TOKENS, transport="shm")
        with pytest.raises((ConnectionError, MoecommError), match="DeviceClient"):
            client.connect()
    finally:
        http.stop()
        host.close()
