"""The GPU path's host side, checked where there is no GPU: handshake refusals over real HTTP,
the command-line entry points failing at once with the reason, the slot-layout offer.

What needs a device (the kernels, the server loop, CUDA IPC) is in tests/gpu/
(test_device_roundtrip.py, test_device_handshake.py) and skips here.
"""

import subprocess
import sys

import httpx
import moecomm.wire.cuda
import pytest
from moecomm.errors import MoecommError
from moecomm.runtime import ExpertServer, random_experts
from moecomm.runtime.control import HttpServer, http_transports, make_app
from moecomm.runtime.device_handshake import check_device_offer
from moecomm.wire.choose import boot_id
from moecomm.wire.protocol import SlotLayout
from moecomm_serving.cli.device import parse_random_spec

LAYOUT = SlotLayout(8, 64, 2)
CLI = [sys.executable, "-m", "moecomm_serving.cli"]
NO_GPU = not moecomm.wire.cuda.available()


@pytest.fixture
def host_server():
    server = ExpertServer(random_experts(1, 4, 64, 32), "host-server", transport="shm")
    http = HttpServer(make_app(server))
    url = http.start()
    server.start()
    try:
        yield url
    finally:
        http.stop()
        server.close()


def _connect_body(transport: str) -> dict:
    return {
        "client_id": 5,
        "client_handle": "cuda_ipc:1:x",
        "layout": LAYOUT.to_dict(),
        "num_slots": 2,
        "transport": transport,
        "response_ring_offset": 0,
    }


@pytest.mark.timeout(60)
def test_a_device_client_at_a_host_server_is_refused_naming_the_fix(host_server):
    r = httpx.post(f"{host_server}/connect", json=_connect_body("cuda_ipc"), timeout=10)
    assert r.status_code == 400
    assert "started with --device cuda" in r.json()["detail"]
    # The client side refuses before it sends anything: the offer says shm only.
    offer = http_transports(host_server)
    with pytest.raises(MoecommError, match="--device cuda"):
        check_device_offer(host_server, offer, LAYOUT, 2)


@pytest.mark.timeout(60)
def test_a_host_connect_naming_a_ring_offset_is_refused(host_server):
    body = {**_connect_body("shm"), "response_ring_offset": 4096}
    r = httpx.post(f"{host_server}/connect", json=body, timeout=10)
    assert r.status_code == 400
    assert "cuda_ipc clients" in r.json()["detail"]


def test_a_gpu_offer_from_another_node_or_layout_is_refused_before_connecting():
    offer = {"transports": ["cuda_ipc"], "boot_id": boot_id(), "layout": LAYOUT.to_dict()}
    check_device_offer("u", offer, LAYOUT, 2)  # the same node, the same layout: fine
    with pytest.raises(MoecommError, match="another node"):
        check_device_offer("u", {**offer, "boot_id": "elsewhere"}, LAYOUT, 2)
    with pytest.raises(MoecommError, match="slot layout"):
        check_device_offer("u", offer, SlotLayout(16, 64, 2), 2)
    with pytest.raises(MoecommError, match="slots"):
        check_device_offer("u", {**offer, "num_slots": 4}, LAYOUT, 2)


@pytest.mark.skipif(not NO_GPU, reason="checks the refusal on a machine without a GPU")
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--device", "cuda"],
        ["frontend", "--device", "cuda", "--checkpoint", "/nonexistent", "--servers", "http://x"],
        ["expert-server", "--device", "cuda", "--random-experts", "layers=1,experts=2,hidden=64"],
    ],
)
def test_gpu_commands_fail_at_once_saying_why_without_a_gpu(argv):
    r = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=110)
    assert r.returncode != 0
    err = r.stderr + r.stdout
    assert "needs a GPU" in err and "Traceback" not in err


def test_random_expert_specs_are_checked():
    assert parse_random_spec("layers=2,experts=16")["experts"] == 16
    for bad in ("layers=0", "wings=2", "hidden=x", "experts"):
        with pytest.raises(SystemExit):
            parse_random_spec(bad)


@pytest.mark.timeout(60)
def test_an_nvshmem_job_hands_out_its_id_and_ranks_over_the_control_plane(host_server):
    import os

    from moecomm.runtime.nvshmem_job import NvshmemJob, join_job

    # A host server runs no job: the route says so.
    with pytest.raises(ConnectionError, match="no NVSHMEM job"):
        join_job(host_server, "a")
    server = ExpertServer(random_experts(1, 2, 64, 32), "job-server", transport="shm")
    # The id's bytes are NVSHMEM's to draw on a GPU (NvshmemJob.create); here any 128 bytes.
    uid = os.urandom(128)
    server.nvshmem_job = NvshmemJob(3, uid, creator="job-server")
    http = HttpServer(make_app(server, token="t"))
    url = http.start()
    try:
        with pytest.raises(ConnectionError, match="401"):
            join_job(url, "a", token="wrong")
        a = join_job(url, "a", token="t")
        assert a == {"unique_id": uid, "rank": 1, "nranks": 3}
        assert join_job(url, "a", token="t")["rank"] == 1  # asking again: the same rank
        assert join_job(url, "b", token="t")["rank"] == 2
        with pytest.raises(ConnectionError, match="job is full"):
            join_job(url, "c", token="t")
        assert httpx.get(f"{url}/nvshmem", timeout=10).json() == {"nranks": 3, "joined": 3}
    finally:
        http.stop()
        server.close()


# ------------------------------------------------------------------ warm-up before "listening"
class _WarmingServer(ExpertServer):
    """A host server with the GPU server's warm-up hook: records what had been printed and
    whether the loop or the control plane were up when it ran."""

    def __init__(self, capsys):
        super().__init__(random_experts(1, 2, 64, 32), "warm-server", transport="shm")
        self.capsys, self.seen = capsys, None

    def warm_up(self) -> float:
        self.seen = {
            "printed": self.capsys.readouterr().out,
            "loop running": self._thread is not None,
        }
        return 0.5


@pytest.mark.timeout(60)
def test_a_server_warms_up_before_it_says_it_listens(capsys):
    import argparse

    from moecomm_serving.cli.expert_server import start_serving

    args = argparse.Namespace(
        token="", host="127.0.0.1", port=0, id=None, device="cpu", monitor=None, ttl=5.0
    )
    server = _WarmingServer(capsys)
    http = start_serving(args, server, [0], [0, 1])
    try:
        assert server.seen is not None, "the warm-up hook was not called"
        assert "listening" not in server.seen["printed"], "ready before the kernels were warm"
        assert not server.seen["loop running"], "the loop (and its first pass) ran before warm-up"
        after = capsys.readouterr().out
        assert "warm in 0.5 s" in after and "listening on http://127.0.0.1:" in after
        assert after.index("warm in") < after.index("listening")
        # Launchers (demo, tests) take the first line starting "expert server" as the ready one.
        ready = [ln for ln in after.splitlines() if ln.startswith("expert server")]
        assert " listening on " in ready[0]
    finally:
        http.stop()
        server.close()


def test_the_gpu_server_warms_up_before_its_loop_takes_a_pass():
    """DeviceExpertServer.start: warm-up first, then the loop (whose passes a client's first
    request meets). Driven without a device: the server's own start() with stand-in passes."""
    import threading

    from moecomm.runtime.device_server import DeviceExpertServer

    order, stepped = [], threading.Event()
    server = DeviceExpertServer.__new__(DeviceExpertServer)
    server.server_id, server._thread, server._stop = "gpu-stand-in", None, threading.Event()
    server.warm_up = lambda: order.append("warm-up") or 0.0

    def step(timeout):
        order.append("pass")
        stepped.set()
        server._stop.set()
        return 0

    server.step = step
    server.start()
    assert stepped.wait(10)
    server._thread.join(10)
    assert order[:2] == ["warm-up", "pass"]
