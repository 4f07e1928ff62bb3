"""The GPU path end to end: `moecomm expert-server --device cuda` processes, a DeviceClient in
this process, CUDA IPC between them on one GPU (stage `core` of `make gpu-check`; the
sanitizer runs on the one-process loopback test, test_smoke_loopback.py, instead).

Attacks timing the way production does: a new token count every step, slots reused the
instant they are released, a server stopped (SIGSTOP) until the client's deadline passes and the
same slot then reused on a replica, a server killed mid-run, a drained server, a step captured
in a CUDA graph and replayed with new inputs. Every answer is checked against a reference
computed here from the same seeded weights that rounds to bfloat16 where the GPU path rounds
(tests/gpu/roundtrip_reference.py), and a mismatch names the step, the token's experts and the
element.

The servers that every test can share start once per module, all at once (a GPU expert server's
start is seconds: a CUDA context and Triton's compiles); a test that stops, kills or drains a
server starts its own, concurrently too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from roundtrip_reference import assert_matches, fp8_close

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

LAYERS, EXPERTS, HIDDEN, INTER, SEED = 2, 8, 256, 128, 3
SPEC = f"layers={LAYERS},experts={EXPERTS},hidden={HIDDEN},intermediate={INTER},seed={SEED}"
TOPK, MAX_TOKENS = 4, 64
# Steps of the sizes test (MOECOMM_ROUNDTRIP_STEPS: more for a soak). 24 steps cover token
# counts 1..64 (7 apart, modulo 64) on both layers within the file's cap in the GPU check
# (tools/gpu_check_plan.py: 60 s with the servers' start).
STEPS = int(os.environ.get("MOECOMM_ROUNDTRIP_STEPS", "24"))
CLI = [sys.executable, "-m", "moecomm_serving.cli"]
START_TIMEOUT_S = 180


class Servers:
    """GPU expert server processes; all of them stopped and reaped at the end, pass or fail."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, experts: str, encoding: str = "bf16") -> tuple[str, subprocess.Popen]:
        return self.start_many([(experts, encoding)])[0]

    def start_many(self, specs: list[tuple[str, str]]) -> list[tuple[str, subprocess.Popen]]:
        """Starts one server per (experts, encoding) at once; (url, process) of each, in order,
        once every one said it listens."""
        procs = []
        for experts, encoding in specs:
            argv = [*CLI, "expert-server", "--device", "cuda", "--random-experts", SPEC,
                    "--experts", experts, "--max-tokens", str(MAX_TOKENS), "--topk", str(TOPK),
                    "--encoding", encoding, "--port", "0"]  # fmt: skip
            p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, start_new_session=True)  # fmt: skip
            self.procs.append(p)
            procs.append(p)
        with ThreadPoolExecutor(len(procs)) as pool:
            urls = list(pool.map(self._wait_listening, procs))
        return list(zip(urls, procs, strict=True))

    @staticmethod
    def _wait_listening(p: subprocess.Popen) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        lines = []
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if " listening on " in line:
                return line.split(" listening on ")[1].split(": layers")[0]
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


class Shared:
    """The module's servers: experts 0-3 and 4-7 (bf16), all experts in fp8, and a pair of
    all-expert bf16 replicas; started together, used by every test that leaves them as it found
    them."""

    def __init__(self, servers: Servers):
        (self.low, _), (self.high, _), (self.fp8, _), (self.a, self.pa), (self.b, _) = (
            servers.start_many(
                [("0-3", "bf16"), ("4-7", "bf16"), ("0-7", "fp8_e4m3_b128"), ("0-7", "bf16"),
                 ("0-7", "bf16")]
            )
        )  # fmt: skip


@pytest.fixture(scope="module")
def module_servers():
    s = Servers()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def shared(module_servers):
    return Shared(module_servers)


@pytest.fixture
def servers():
    """Servers of one test (the ones it stops, kills or drains)."""
    s = Servers()
    try:
        yield s
    finally:
        s.close()


def experts_of_layer(layer: int):
    from moecomm.runtime import random_experts

    return random_experts(LAYERS, EXPERTS, HIDDEN, INTER, seed=SEED, dtype=torch.bfloat16)[layer]


def inputs(g: torch.Generator, n: int):
    x = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(n)]).int()
    w = torch.rand(n, TOPK, generator=g)
    return x, ids, w


def check(client, x, ids, w, layer=0, step="-"):
    dev = client.device
    h = client.dispatch(x.to(dev), ids.to(dev), w.to(dev), layer)
    y = client.combine(h).float().cpu()
    assert_matches(y, x, ids, w, experts_of_layer(layer), f"step {step} (layer {layer})")


def connect(urls, **kw):
    from moecomm.runtime import DeviceClient

    return DeviceClient.from_servers(urls, device="cuda:0", **kw)


def test_sizes_change_every_step_and_slots_are_reused_at_once(shared):
    client = connect([shared.low, shared.high], timeout=5.0)
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(STEPS):
            n = 1 + (step * 7) % MAX_TOKENS
            check(client, *inputs(g, n), layer=step % LAYERS, step=step)
        # Two steps in flight on the two slots, combined out of order.
        xs = [inputs(g, 5 + i) for i in range(2)]
        dev = client.device
        hs = [client.dispatch(x.to(dev), i.to(dev), w.to(dev), 0) for x, i, w in xs]
        for j, (h, (x, ids, w)) in reversed(list(enumerate(zip(hs, xs, strict=True)))):
            y = client.combine(h).float().cpu()
            assert_matches(y, x, ids, w, experts_of_layer(0), f"in-flight step {j} (layer 0)")
    finally:
        client.close()


def test_fp8_requests_are_served_through_the_scaled_grouped_gemm(shared):
    client = connect([shared.fp8], timeout=5.0)
    g = torch.Generator().manual_seed(1)
    try:
        for step, n in enumerate((1, 17, MAX_TOKENS)):
            x, ids, w = inputs(g, n)
            dev = client.device
            y = client.combine(client.dispatch(x.to(dev), ids.to(dev), w.to(dev), 1)).float()
            fp8_close(y.cpu(), x, ids, w, experts_of_layer(1), f"fp8 step {step} ({n} tokens)")
    finally:
        client.close()


def test_a_stopped_server_times_out_and_the_same_slot_is_reused_on_its_replica(shared):
    a, pa, b = shared.a, shared.pa, shared.b
    client = connect([a, b], timeout=0.5)
    g = torch.Generator().manual_seed(2)
    try:
        check(client, *inputs(g, 8), step="before the stop")
        os.killpg(pa.pid, signal.SIGSTOP)  # A still maps our memory, answers nothing
        for i in range(6):  # the first step evicts A after its deadline, every step is right
            check(client, *inputs(g, 9), step=f"A stopped, {i}")
        os.killpg(pa.pid, signal.SIGCONT)  # A's late answer lands in a ring no longer read
        for i in range(4):
            check(client, *inputs(g, 3), step=f"A continued, not re-added, {i}")
        assert len(client.servers) == 1
        client.add_server(a)  # a fresh ring: A serves again, its late bytes count for nothing
        for i in range(6):
            check(client, *inputs(g, 11), step=f"A re-added, {i}")
    finally:
        os.killpg(pa.pid, signal.SIGCONT)  # the module's later tests use A
        client.close()


def test_a_killed_server_fails_over_without_a_wrong_answer(shared, servers):
    (b, pb), = servers.start_many([("0-7", "bf16")])  # fmt: skip
    client = connect([shared.a, b], timeout=2.0)
    g = torch.Generator().manual_seed(3)
    try:
        for step in range(20):
            if step == 7:
                os.killpg(pb.pid, signal.SIGKILL)
            check(client, *inputs(g, 1 + step % 13), step=step)
    finally:
        client.close()


def test_a_draining_server_answers_draining_and_its_replica_serves(servers):
    import httpx
    from moecomm.runtime import DeviceStepFailedError

    (a, _), (b, _) = servers.start_many([("0-7", "bf16"), ("0-7", "bf16")])
    client = connect([a, b], timeout=2.0)
    g = torch.Generator().manual_seed(4)
    try:
        httpx.post(f"{a}/drain", json={"token": ""}, timeout=10).raise_for_status()
        for i in range(5):
            check(client, *inputs(g, 6), step=f"A drained, {i}")
        httpx.post(f"{b}/drain", json={"token": ""}, timeout=10).raise_for_status()
        with pytest.raises(DeviceStepFailedError, match="no live server"):
            check(client, *inputs(g, 6), step="both drained")
    finally:
        client.close()


def test_a_step_captured_in_a_cuda_graph_replays_with_new_inputs(shared):
    client = connect([shared.b], timeout=5.0)
    g = torch.Generator().manual_seed(5)
    n, dev = 16, torch.device("cuda:0")
    x = torch.zeros(n, HIDDEN, dtype=torch.bfloat16, device=dev)
    ids = torch.zeros(n, TOPK, dtype=torch.int32, device=dev)
    w = torch.zeros(n, TOPK, device=dev)
    out = torch.empty(n, HIDDEN, dtype=torch.bfloat16, device=dev)
    try:
        check(client, *inputs(g, n), step="before the capture")  # warm: maps built
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            client.launch(x, ids, w, 0, slot=0)
            client.wait(n, 0, 0, out)
        for replay in range(5):
            xi, ii, wi = inputs(g, n)
            x.copy_(xi)
            ids.copy_(ii)
            w.copy_(wi)
            graph.replay()
            torch.cuda.synchronize(dev)
            status, _ = client.status(0)
            assert set(status.tolist()) <= {0, 3}, f"replay {replay}: statuses {status}"
            assert_matches(out.float().cpu(), xi, ii, wi, experts_of_layer(0), f"replay {replay}")
    finally:
        client.close()


def test_host_and_gpu_peers_refuse_each_other_naming_the_fix(shared):
    from moecomm.errors import MoecommError
    from moecomm.runtime import AttentionClient, ExpertServer, random_experts
    from moecomm.runtime.control import HttpServer, make_app

    gpu_url = shared.b
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
