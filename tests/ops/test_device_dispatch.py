"""Device dispatch/combine (csrc/kernels/cuda/client_*.cuh, server_*.cuh) against the host path.

On any machine: the index math the kernels use (dispatch_index.h) is replayed by a small g++
program and must produce exactly pack_dispatch's payloads and combine's sums; the launchers and
the Python wrapper reject bad arguments with clear errors. On a GPU (marked gpu): an nvcc-built
check program runs the real kernels in one process over the CUDA-IPC backend with loopback
servers, bit-exact against the same host expectations, under CUDA-graph replay, and with a
server that never answers (timeout within the deadline, no hang).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import moecomm.wire.cuda
import pytest
import torch
from device_dispatch_data import (
    DTYPE_ENCODING,
    ELEM_BYTES,
    device_tables,
    expected_round_trip,
    make_case,
    pack_i32,
    pack_u32,
    payload_bytes,
    raw,
)
from moecomm._C import Encoding
from moecomm.ops.combine import combine
from moecomm.ops.dispatch import pack_dispatch
from moecomm.ops.quant import QUANTIZED_ENCODINGS, encoding_dtype, quantize
from moecomm.wire.protocol import SlotLayout

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
ENCODINGS = [
    Encoding.BF16,
    Encoding.FP16,
    Encoding.F32,
    Encoding.INT8,
    Encoding.FP8_E4M3,
    Encoding.FP8_E4M3_B128,
]


@pytest.fixture(scope="module")
def replay_exe(tmp_path_factory) -> Path:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("needs g++ to build the index-math replay")
    exe = tmp_path_factory.mktemp("native") / "dispatch_index_check"
    src = HERE / "native" / "dispatch_index_check.cc"
    cmd = [gxx, "-std=c++20", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'csrc'}"]
    subprocess.run([*cmd, str(src), "-o", str(exe)], check=True)
    return exe


def test_workspace_layouts_are_aligned_and_disjoint(replay_exe):
    run = subprocess.run([str(replay_exe), "layouts"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "OK"


@pytest.mark.parametrize("enc", ENCODINGS, ids=lambda e: e.name)
@pytest.mark.parametrize("ids_int64", [True, False])
@pytest.mark.parametrize(("tokens", "hidden", "servers"), [(13, 200, 3), (1, 7, 1), (40, 130, 5)])
def test_index_replay_matches_pack_dispatch_and_combine(
    replay_exe, tmp_path, enc, ids_int64, tokens, hidden, servers
):
    topk, experts = 4, 9
    x, ids, weights, emap, replica = make_case(tokens, hidden, topk, servers, experts, seed=tokens)
    batches = pack_dispatch(x, ids, weights, emap, encoding=enc, replica=replica)
    if enc in QUANTIZED_ENCODINGS:
        wire, scales = quantize(x, enc)
    else:
        wire, scales = x.to(encoding_dtype(enc)), None
    server, local = device_tables(emap, replica)
    counts = {b.server: b.num_tokens for b in batches}
    partials = [torch.randn(counts.get(s, 0), hidden) for s in range(servers)]
    blob = pack_u32(tokens, hidden, topk, servers, experts, int(enc), int(ids_int64))
    blob += pack_i32(server) + pack_i32(local)
    blob += raw(ids if ids_int64 else ids.to(torch.int32)) + raw(weights.float()) + raw(wire)
    blob += raw(scales) if scales is not None else b""
    blob += b"".join(raw(p) for p in partials)
    (tmp_path / "in.bin").write_bytes(blob)
    run = subprocess.run(
        [str(replay_exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    out = (tmp_path / "out.bin").read_bytes()
    pos = torch.frombuffer(bytearray(out[: tokens * servers * 4]), dtype=torch.int32)
    pos = pos.view(tokens, servers)
    at = tokens * servers * 4
    by_server = {b.server: b for b in batches}
    for s in range(servers):
        count, nbytes = struct.unpack_from("<IQ", out, at)
        at += 12
        got = out[at : at + nbytes]
        at += nbytes
        b = by_server.get(s)
        assert count == (b.num_tokens if b else 0), f"server {s}"
        rows = torch.nonzero(pos[:, s] >= 0).squeeze(1)
        assert torch.equal(pos[rows, s].long(), torch.arange(rows.numel())), f"server {s}"
        if b is None:
            continue
        assert torch.equal(rows, b.token_index), f"server {s}: rows keep batch order"
        assert got == payload_bytes(b, hidden, topk, enc), f"server {s}: payload differs"
    y = torch.frombuffer(bytearray(out[at:]), dtype=torch.float32).view(tokens, hidden)
    sent = [s for s in range(servers) if s in by_server]
    want = combine(
        [partials[s] for s in sent],
        [by_server[s].token_index for s in sent],
        tokens,
        hidden=hidden,
        dtype=torch.float32,
    )
    assert torch.equal(y, want)


# ------------------------------------------------------------------------------ argument checks
def _cuda():
    return pytest.importorskip("moecomm._cuda", reason="moecomm._cuda not built (no nvcc)")


def _client_config(k, **over):
    cfg = k.ClientConfig()
    cfg.num_servers, cfg.num_slots, cfg.client_id = 2, 2, 7
    cfg.max_tokens, cfg.hidden, cfg.topk = 8, 64, 2
    cfg.encoding, cfg.out_encoding = int(Encoding.BF16), int(Encoding.BF16)
    cfg.request_ring_offset = cfg.response_ring_offset = 64
    for name, value in over.items():
        setattr(cfg, name, value)
    return cfg


def _peers(k, max_peers=4):
    p = k.IpcPeers()
    p.local_base, p.peer_base, p.alive, p.max_peers = 1 << 20, 1 << 21, 1 << 22, max_peers
    return p


def _dispatch_args(k, **over):
    a = k.DispatchArgs()
    a.x = a.topk_ids = a.topk_weights = a.expert_server = a.expert_local = 4096
    a.next_seq, a.workspace = 4096, 1 << 16
    a.x_row_stride, a.num_tokens, a.topk, a.num_experts = 64, 4, 2, 3
    for name, value in over.items():
        setattr(a, name, value)
    return a


@pytest.mark.parametrize(
    ("cfg_over", "args_over", "match"),
    [
        ({"num_servers": 0}, {}, "num_servers must be >= 1"),
        ({"num_servers": 5}, {}, "exceeds the peer table's max_peers 4"),
        ({"topk": 65}, {"topk": 1}, "topk must be in \\[1, 64\\]"),
        ({"out_encoding": int(Encoding.INT8)}, {}, "response encoding must be BF16, FP16 or F32"),
        ({}, {"slot": 2}, "slot 2 out of range for 2 slots"),
        ({}, {"num_tokens": 9}, "9 tokens exceed max_tokens 8"),
        ({}, {"topk": 3}, "topk must be in \\[1, 2\\], got 3"),
        ({}, {"x_row_stride": 63}, "x_row_stride must be >= hidden"),
        ({}, {"x_dtype": int(Encoding.INT8)}, "x must be BF16, FP16, F32 or already quantized"),
        ({}, {"workspace": 4097}, "64-byte aligned"),
        ({}, {"next_seq": 0}, "next_seq"),
        ({}, {"num_experts": 0}, "expert map"),
    ],
)
def test_dispatch_launcher_rejects_bad_arguments(cfg_over, args_over, match):
    k = _cuda()
    with pytest.raises(ValueError, match=match):
        k.client_dispatch(_peers(k), _client_config(k, **cfg_over), _dispatch_args(k, **args_over))


def test_combine_launcher_rejects_bad_arguments():
    k = _cuda()
    a = k.CombineArgs()
    a.num_tokens, a.workspace, a.out = 4, 1 << 16, 4096
    with pytest.raises(ValueError, match="timeout_ns must be > 0"):
        k.client_combine(_peers(k), _client_config(k), a)
    a.timeout_ns, a.out = 10**6, 0
    with pytest.raises(ValueError, match="out must be a non-null"):
        k.client_combine(_peers(k), _client_config(k), a)


def test_encoding_fields_reject_unknown_values():
    k = _cuda()
    with pytest.raises(ValueError, match="encoding: expected an Encoding value in \\[1, 6\\]"):
        _client_config(k, encoding=0)


def test_server_launchers_reject_bad_arguments():
    k = _cuda()
    cfg = k.ServerConfig()
    cfg.num_clients, cfg.num_slots, cfg.num_experts, cfg.max_step_tokens = 1, 2, 4, 8
    cfg.max_tokens, cfg.hidden, cfg.topk = 8, 63, 2
    cfg.encoding, cfg.out_encoding = int(Encoding.FP8_E4M3), int(Encoding.BF16)
    cfg.client_ids = cfg.request_ring_offset = cfg.response_ring_offset = 4096
    g = k.ServerGatherArgs()
    g.workspace, g.block_m = 1 << 16, 16
    with pytest.raises(ValueError, match="even number of bytes"):
        k.server_gather(_peers(k), cfg, g)
    cfg.hidden, cfg.max_step_tokens = 64, 4
    with pytest.raises(ValueError, match="max_step_tokens \\(4\\) must hold at least one full"):
        k.server_gather(_peers(k), cfg, g)
    cfg.max_step_tokens = 8
    r = k.ServerRespondArgs()
    r.workspace = 1 << 16
    with pytest.raises(ValueError, match="expert_out must be a non-null"):
        k.server_respond(_peers(k), cfg, r)


def test_valid_launch_without_a_device_is_a_cuda_error():
    k = _cuda()
    if k.device_count() > 0:
        pytest.skip("a device is present: a launch with fake pointers would fault")
    with pytest.raises(RuntimeError, match="CUDA error"):
        k.client_dispatch(_peers(k), _client_config(k), _dispatch_args(k))


def test_device_client_refuses_a_cpu_device_and_a_missing_build(monkeypatch):
    from moecomm.runtime import DeviceClient

    layout = SlotLayout(8, 64, 2)
    # Without a device the module refuses first, naming why; with one, the CPU device does.
    with pytest.raises((RuntimeError, ValueError), match=r"(?i)cuda"):
        DeviceClient(layout, device="cpu")
    monkeypatch.setattr(moecomm.wire.cuda, "_import_native", lambda name: None)
    with pytest.raises(RuntimeError, match=r"moecomm\._cuda was not built"):
        DeviceClient(layout, device="cuda")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_program_is_built_once_per_run(nvcc_program, tmp_path):
    """The session fixture behind the GPU checks below: the first request builds, the next
    ones with the same sources and flags reuse the binary; an edited source builds anew; a
    failed build fails the test with nvcc's message (and again, without rebuilding)."""
    src = tmp_path / "tiny.cu"
    src.write_text("__global__ void k(int* p) { *p = 1; }\nint main() { return 0; }\n")
    flags = ["-arch=sm_90"]  # any real arch: this only compiles
    first = nvcc_program("tiny", [src], flags)
    stamp = first.stat().st_mtime_ns
    assert first.is_file() and nvcc_program("tiny", [src], flags) == first
    assert first.stat().st_mtime_ns == stamp, "rebuilt"
    src.write_text(src.read_text() + "// edited\n")
    assert nvcc_program("tiny", [src], flags) != first
    bad = tmp_path / "bad.cu"
    bad.write_text("this is not CUDA\n")
    for _ in range(2):
        with pytest.raises(pytest.fail.Exception, match="bad: nvcc failed"):
            nvcc_program("bad", [bad], flags)


# ------------------------------------------------------------------------------ on a GPU
@pytest.fixture
def check_exe(nvcc_program) -> Path:
    """tests/ops/cuda/device_dispatch_check.cu with the kernels, built once per test run (the
    session fixture in tests/conftest.py; 20-35 s of nvcc) and shared by every test here."""
    kernels = ROOT / "csrc" / "kernels" / "cuda"
    sources = [
        HERE / "cuda" / "device_dispatch_check.cu",
        kernels / "device_dispatch.cu",
        kernels / "reorg.cu",
        kernels / "scan.cu",
    ]
    return nvcc_program("device_dispatch_check", sources, ["-arch=native"])


def _gpu_check(exe: Path, tmp_path: Path, blob: bytes, mode: str) -> str:
    (tmp_path / "case.bin").write_bytes(blob)
    run = subprocess.run(
        [str(exe), mode, str(tmp_path / "case.bin")], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def _gpu_case(
    enc: Encoding,
    steps: int,
    tokens=24,
    hidden=256,
    topk=4,
    servers=3,
    experts=10,
    x_dtype=torch.bfloat16,
    out_dtype=torch.bfloat16,
) -> bytes:
    """The GPU check's input: shapes, the device expert map, then per step the inputs and the
    host path's expected payloads and combine result (see device_dispatch_check.cu)."""
    _, _, _, emap, replica = make_case(tokens, hidden, topk, servers, experts, seed=0)
    server, local = device_tables(emap, replica)
    blob = pack_u32(
        tokens,
        hidden,
        topk,
        servers,
        experts,
        int(enc),
        int(DTYPE_ENCODING[x_dtype]),
        int(DTYPE_ENCODING[out_dtype]),
        steps,
    )
    blob += pack_i32(server) + pack_i32(local)
    for step in range(steps):
        x, ids, weights, _, _ = make_case(
            tokens, hidden, topk, servers, experts, seed=step, x_dtype=x_dtype
        )
        batches, y = expected_round_trip(x, ids, weights, emap, replica, enc, out_dtype)
        blob += raw(x) + raw(ids) + raw(weights.float())
        by_server = {b.server: b for b in batches}
        for s in range(servers):
            b = by_server.get(s)
            payload = payload_bytes(b, hidden, topk, enc) if b else b""
            blob += struct.pack("<IQ", b.num_tokens if b else 0, len(payload)) + payload
        blob += raw(y)
    assert ELEM_BYTES[enc] >= 1
    return blob


@pytest.mark.gpu
@pytest.mark.parametrize("enc", ENCODINGS, ids=lambda e: e.name)
def test_gpu_dispatch_server_combine_bit_exact(check_exe, tmp_path, enc):
    assert _gpu_check(check_exe, tmp_path, _gpu_case(enc, steps=1), "roundtrip").strip() == "OK"


@pytest.mark.gpu
def test_gpu_client_step_graph_replays(check_exe, tmp_path):
    # Captured once, replayed with new inputs: new sequence numbers, bit-exact every time.
    out = _gpu_check(check_exe, tmp_path, _gpu_case(Encoding.FP8_E4M3, steps=4), "graph")
    assert out.strip() == "OK"


@pytest.mark.gpu
def test_gpu_combine_times_out_when_no_server_answers(check_exe, tmp_path):
    out = _gpu_check(check_exe, tmp_path, _gpu_case(Encoding.BF16, steps=1), "timeout")
    assert out.strip() == "OK"
