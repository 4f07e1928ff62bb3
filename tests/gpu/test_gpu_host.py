"""The GPU modules on any machine: they import, say why there is no device, refuse every call
with a clear Python error instead of crashing, and reject malformed handles and unique ids
before any CUDA call. On a GPU machine the no-device assertions are skipped."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import moecomm
import moecomm.wire.cuda
import pytest

NO_GPU = not moecomm.wire.cuda.available()
needs_no_gpu = pytest.mark.skipif(not NO_GPU, reason="checks the no-device behaviour")

BOOT_ID = "0123abcd-4567-89ef-0123-456789abcdef"
UUID = "00112233445566778899aabbccddeeff"
MEM = bytes(range(64))


def handle_fields(**over):
    fields = dict(
        boot_id=BOOT_ID, pid=4242, start_ticks=987654, device_uuid=UUID, bytes=1 << 20, mem=MEM
    )
    fields.update(over)
    return fields


def handle_text(**over):
    f = handle_fields(**over)
    return (
        f"cuda_ipc:1:{f['boot_id']}:{f['pid']}:{f['start_ticks']}:{f['device_uuid']}:"
        f"{f['bytes']}:{f['mem'].hex()}"
    )


def test_moecomm_imports_without_a_gpu_in_a_fresh_process():
    code = "import moecomm, moecomm.wire.cuda; print(moecomm.wire.cuda.available())"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@needs_no_gpu
def test_discovery_reports_no_device_with_a_reason():
    assert moecomm.wire.cuda.device_count() == 0
    assert moecomm.wire.cuda.available() is False
    reason = moecomm.wire.cuda.why_unavailable()
    assert isinstance(reason, str) and reason
    assert moecomm.wire.cuda.ipc_handle.__module__ == "moecomm.wire.cuda"
    assert moecomm.wire.cuda is moecomm.__getattr__("wire").cuda


@needs_no_gpu
def test_native_modules_report_no_device(cuda_native, nvshmem_native):
    for mod in (cuda_native, nvshmem_native):
        assert mod.device_count() == 0
        assert mod.no_device_reason()


@needs_no_gpu
@pytest.mark.parametrize("name", ["_cuda", "_nvshmem"])
def test_loader_says_no_device_when_built(name):
    if not moecomm.wire.cuda.built(name):
        pytest.skip(f"moecomm.{name} not built")
    load = moecomm.wire.cuda.cuda_module if name == "_cuda" else moecomm.wire.cuda.nvshmem_module
    with pytest.raises(
        moecomm.wire.cuda.GpuUnavailableError, match="is built, but there is no device"
    ):
        load()
    assert load(need_device=False).__name__ == f"moecomm.{name}"


@pytest.mark.parametrize("name", ["_cuda", "_nvshmem"])
def test_loader_says_not_built(monkeypatch, name):
    real = importlib.import_module

    def fake(modname, *a, **k):
        if modname == f"moecomm.{name}":
            raise ModuleNotFoundError(modname)
        return real(modname, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)
    load = moecomm.wire.cuda.cuda_module if name == "_cuda" else moecomm.wire.cuda.nvshmem_module
    with pytest.raises(moecomm.wire.cuda.GpuUnavailableError, match="was not built"):
        load(need_device=False)
    assert moecomm.wire.cuda.built(name) is False


def test_built_rejects_unknown_module():
    with pytest.raises(ValueError, match="unknown native GPU module"):
        moecomm.wire.cuda.built("_C")


def test_ipc_types_derive_from_the_core_transport(cuda_native):
    from moecomm import _C

    assert issubclass(cuda_native.IpcTransport, _C.Transport)
    assert issubclass(cuda_native.IpcRegion, _C.Region)


@needs_no_gpu
def test_ipc_bindings_raise_instead_of_crashing(cuda_native):
    with pytest.raises(moecomm.SystemCallError, match="no usable CUDA device"):
        cuda_native.IpcTransport()
    with pytest.raises(moecomm.SystemCallError, match="no usable CUDA device"):
        cuda_native.IpcTransport(device=0)
    with pytest.raises(ValueError, match="needs a transport"):
        cuda_native.IpcPeerTable(None, None, 4)


@needs_no_gpu
def test_cuda_python_helpers_raise_clear_errors():
    with pytest.raises(ValueError, match="positive device address"):
        moecomm.wire.cuda.ipc_handle(0)
    with pytest.raises(ValueError, match="64 bytes"):
        moecomm.wire.cuda.open_ipc_handle(b"short")
    with pytest.raises(moecomm.wire.cuda.GpuUnavailableError, match="cudaIpcGetMemHandle failed"):
        moecomm.wire.cuda.ipc_handle(0x7F0000000000)
    with pytest.raises(moecomm.wire.cuda.GpuUnavailableError, match="cudaIpcOpenMemHandle failed"):
        moecomm.wire.cuda.open_ipc_handle(bytes(64))


def test_handle_round_trip(cuda_native):
    text = cuda_native.format_ipc_handle(BOOT_ID, 4242, 987654, UUID, 1 << 20, MEM)
    assert text == handle_text()
    f = cuda_native.parse_ipc_handle(text)
    assert f == {
        "boot_id": BOOT_ID,
        "pid": 4242,
        "start_ticks": 987654,
        "device_uuid": UUID,
        "bytes": 1 << 20,
        "mem_handle": MEM,
    }
    again = cuda_native.format_ipc_handle(
        f["boot_id"], f["pid"], f["start_ticks"], f["device_uuid"], f["bytes"], f["mem_handle"]
    )
    assert again == text
    # Upper-case hex is accepted and normalised.
    upper = handle_text(device_uuid=UUID.upper())
    assert cuda_native.parse_ipc_handle(upper)["device_uuid"] == UUID


MALFORMED = [
    ("", "not a cuda_ipc handle"),
    ("shm:moecomm-1-2-3-abc", "not a cuda_ipc handle"),
    ("cuda_ipc:", "fields"),
    (handle_text() + ":extra", "fields"),
    (handle_text().replace("cuda_ipc:1:", "cuda_ipc:2:"), "version 2 is not supported"),
    (handle_text().replace("cuda_ipc:1:", "cuda_ipc:x:"), "version must be a decimal"),
    (handle_text(boot_id="not-a-boot-id"), "boot id"),
    (handle_text(boot_id=BOOT_ID.replace("-", "x")), "boot id"),
    (handle_text(pid=0), "pid 0 out of range"),
    (handle_text(pid="-5"), "pid must be a decimal"),
    (handle_text(pid="99999999999999999999999"), "pid must be a decimal"),
    (handle_text(start_ticks="12a"), "start ticks must be a decimal"),
    (handle_text(start_ticks="99999999999999999999"), "overflows"),
    (handle_text(device_uuid=UUID[:-2]), "GPU UUID must be 32 hex digits"),
    (handle_text(device_uuid="zz" + UUID[2:]), "GPU UUID has a non-hex"),
    (handle_text(bytes=0), "region size 0"),
    (handle_text(bytes=1 << 60), "region size"),
    (handle_text(mem=MEM[:63]), "memory handle must be 128 hex digits"),
    (handle_text()[:-1] + "g", "memory handle has a non-hex"),
]


@pytest.mark.parametrize(("text", "match"), MALFORMED)
def test_malformed_handles_are_rejected(cuda_native, text, match):
    with pytest.raises(ValueError, match=match):
        cuda_native.parse_ipc_handle(text)
    with pytest.raises(ValueError, match=match):
        cuda_native.check_ipc_handle(text)


def test_format_refuses_bad_fields(cuda_native):
    with pytest.raises(ValueError, match="GPU UUID"):
        cuda_native.format_ipc_handle(BOOT_ID, 1, 0, "abc", 64, MEM)
    with pytest.raises(ValueError, match="memory handle"):
        cuda_native.format_ipc_handle(BOOT_ID, 1, 0, UUID, 64, MEM[:10])


def test_attach_checks_node_process_and_owner(cuda_native):
    ours = cuda_native.node_boot_id()
    assert len(ours) == 36
    other_node = handle_text(boot_id=BOOT_ID if ours != BOOT_ID else "f" * 8 + BOOT_ID[8:])
    with pytest.raises(ValueError, match="another node"):
        cuda_native.check_ipc_handle(other_node)
    own = handle_text(boot_id=ours, pid=os.getpid(), start_ticks=0)
    with pytest.raises(ValueError, match="this same process"):
        cuda_native.check_ipc_handle(own)
    # A process that has exited: its handle names an owner that is gone.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    gone = handle_text(boot_id=ours, pid=child.pid, start_ticks=1)
    with pytest.raises(moecomm.PeerLostError, match="is gone"):
        cuda_native.check_ipc_handle(gone)
    # Our parent is alive and another process: accepted (start ticks 0 = do not compare).
    alive = handle_text(boot_id=ours, pid=os.getppid(), start_ticks=0)
    assert cuda_native.check_ipc_handle(alive)["pid"] == os.getppid()


# --- NVSHMEM -----------------------------------------------------------------------------------


def fake_unique_id(size=128, version=(1 << 16) + 128):
    return version.to_bytes(4, "little", signed=True) + bytes(size - 4)


def test_unique_id_size_and_version(nvshmem_native):
    assert nvshmem_native.UNIQUE_ID_BYTES == 128
    nvshmem_native.check_unique_id(fake_unique_id())
    for size in (0, 4, 127, 129, 256):
        with pytest.raises(ValueError, match=f"128 bytes, got {size}"):
            nvshmem_native.check_unique_id(fake_unique_id(size) if size >= 4 else bytes(size))
    with pytest.raises(ValueError, match="not an NVSHMEM unique id"):
        nvshmem_native.check_unique_id(fake_unique_id(version=7))


def test_init_checks_arguments_before_the_device(nvshmem_native):
    with pytest.raises(ValueError, match="128 bytes"):
        nvshmem_native.init(b"short", 0, 1)
    with pytest.raises(ValueError, match="rank 2 outside"):
        nvshmem_native.init(fake_unique_id(), 2, 2)
    with pytest.raises(ValueError, match="nranks must be >= 1"):
        nvshmem_native.init(fake_unique_id(), 0, 0)
    with pytest.raises(ValueError, match="rank -1 outside"):
        nvshmem_native.init(fake_unique_id(), -1, 4)


@needs_no_gpu
def test_nvshmem_bindings_raise_instead_of_crashing(nvshmem_native):
    no_device = pytest.raises(moecomm.SystemCallError, match="no usable CUDA device")
    with no_device:
        nvshmem_native.init(fake_unique_id(), 0, 1)
    with no_device:
        nvshmem_native.get_unique_id()
    for call in (nvshmem_native.my_pe, nvshmem_native.n_pes, nvshmem_native.barrier_all):
        with no_device:
            call()
    with no_device:
        nvshmem_native.finalize()
    with no_device:
        nvshmem_native.NvshmemRegion(4096)
    with no_device:
        nvshmem_native.NvshmemPeerTable(None, 4)
    assert nvshmem_native.initialized() is False
