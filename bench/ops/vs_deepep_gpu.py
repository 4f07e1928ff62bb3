"""The moecomm GPU row of bench/ops/vs_deepep.py: `moecomm expert-server --device cuda` in its own
process (CUDA cannot open its own IPC handle), a DeviceClient here, at DeepEP's low-latency shape.
Never raises: a row that cannot run says why."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
from _lib.common import percentile
from deepep_shape import calc_diff, deepep_bytes, deepep_inputs

# The GPU row's result goes through an expert MLP: the fp8 input error (DeepEP's 7e-4 on the
# identity) passes through it at about the same relative size; bf16 weights and output add little.
GPU_DIFF_LIMIT = 5e-3
GPU_SERVER_START_S = 180.0  # CUDA start-up and the load of every expert of the checkpoint
GPU_CLIENT_TIMEOUT_S = 10.0

# ---------------------------------------------------------------------------------------------
# The moecomm GPU row: DeviceClient here, expert server (--device cuda) in its own process.


class GpuRowNotRun(Exception):
    """The row cannot run here; the message says why."""


def write_gpu_checkpoint(path: str, a) -> None:
    """A one-layer random Mixtral-layout checkpoint of the bench's shape: hidden a.hidden,
    a.num_experts experts of width a.gpu_intermediate, top-a.num_topk; attention is one head of
    width 8 so that nearly all bytes are experts."""
    from moecomm_serving.model.tiny import write_tiny

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        write_tiny(
            path,
            "mixtral",
            seed=0,
            dtype=torch.bfloat16,
            overrides={
                "hidden_size": a.hidden,
                "intermediate_size": a.gpu_intermediate,
                "num_hidden_layers": 1,
                "num_local_experts": a.num_experts,
                "num_experts_per_tok": a.num_topk,
                "num_attention_heads": 1,
                "num_key_value_heads": 1,
                "head_dim": 8,
            },
        )
    finally:
        torch.set_num_threads(threads)


class ServerProcess:
    """``moecomm expert-server --device cuda`` as a child process; its output goes to a log and
    its URL is read from the line ``... listening on http://host:port: ...``."""

    LISTENING = re.compile(r"listening on (https?://[^\s]+?):?\s")

    def __init__(self, cmd: list[str], log_path: str):
        self.log_path = log_path
        self.lines: list[str] = []
        self.url: str | None = None
        self._found = threading.Event()
        self._log = open(log_path, "w")  # noqa: SIM115  closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            self.lines.append(line.rstrip())
            m = self.LISTENING.search(line + " ")
            if m and self.url is None:
                self.url = m.group(1)
                self._found.set()
        self._found.set()  # the process ended

    def wait_url(self, timeout: float) -> str:
        self._found.wait(timeout)
        if self.url is None:
            state = (
                f"exited with {self.proc.poll()}"
                if self.proc.poll() is not None
                else f"printed no URL within {timeout:.0f} s"
            )
            last = " | ".join(self.lines[-3:]) or "no output"
            raise GpuRowNotRun(f"expert server {state}: {last} (log: {self.log_path})")
        return self.url

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the server stops at once on SIGINT
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)
        self._log.close()


def gpu_reference(ckpt_dir: str, x, idx, w) -> torch.Tensor:
    """Σ_k w[t,k] · mlp_{idx[t,k]}(x[t]) in float32 on the GPU, with the checkpoint's weights
    (Mixtral: w2 · (silu(w1 · x) * (w3 · x)))."""
    from moecomm_serving.model.checkpoint import Checkpoint

    experts = sorted({int(e) for e in idx.flatten().tolist() if e >= 0})
    weights = Checkpoint(ckpt_dir).read_experts({0: experts}, torch.bfloat16, device=x.device)[0]
    xf = x.float()
    y = torch.zeros_like(xf)
    for e in experts:
        tok, k = (idx == e).nonzero(as_tuple=True)
        ew = weights[e]
        h = torch.nn.functional.silu(xf[tok] @ ew.w1.float().T) * (xf[tok] @ ew.w3.float().T)
        y.index_add_(0, tok, (h @ ew.w2.float().T) * w[tok, k].float().unsqueeze(1))
    return y


def moecomm_gpu_row(a, work_dir: str, log_dir: str) -> dict:
    """The moecomm GPU row, or {"name", "not_run": reason}. Never raises. The checkpoint goes
    to work_dir (temporary), the server's log to log_dir."""
    name = "moecomm GPU, 1 GPU, CUDA IPC (this run)"
    try:
        return _moecomm_gpu_row(a, work_dir, log_dir, name)
    except GpuRowNotRun as exc:
        return {"name": name, "not_run": str(exc)}
    except Exception as exc:  # the device path is young: report, never crash the host rows
        return {"name": name, "not_run": f"{type(exc).__name__}: {exc}"}


def _moecomm_gpu_row(a, work_dir: str, log_dir: str, name: str) -> dict:
    if not torch.cuda.is_available():
        raise GpuRowNotRun(f"no CUDA device (torch {torch.__version__}: torch.cuda unavailable)")
    try:
        from moecomm.runtime import DeviceClient
    except ImportError as exc:
        raise GpuRowNotRun(f"moecomm.runtime.DeviceClient is not available ({exc})") from exc
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    ckpt = os.path.join(work_dir, "gpu-row-checkpoint")
    t0 = time.perf_counter()
    write_gpu_checkpoint(ckpt, a)
    print(f"GPU row: wrote the checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
    cmd = [
        sys.executable,
        "-m",
        "moecomm_serving.cli",
        "expert-server",
        "--checkpoint",
        ckpt,
        "--layers",
        "0",
        "--experts",
        "all",
        "--dtype",
        "bfloat16",
        "--device",
        "cuda",
        # The server fixes the slot layout; the client adopts it (GET /transports). fp8 with one
        # scale per 128 channels is DeepEP's low-latency dispatch format.
        "--max-tokens",
        str(a.num_tokens),
        "--topk",
        str(a.num_topk),
        "--encoding",
        "fp8_e4m3_b128",
        "--max-clients",
        "1",
        "--port",
        "0",
    ]
    server = ServerProcess(cmd, os.path.join(log_dir, "gpu-row-server.log"))
    client = None
    try:
        url = server.wait_url(GPU_SERVER_START_S)
        client = DeviceClient.from_servers([url], device="cuda:0", timeout=GPU_CLIENT_TIMEOUT_S)
        x, idx, w = (
            t.to(dev) for t in deepep_inputs(0, a.num_tokens, a.hidden, a.num_experts, a.num_topk)
        )
        layer = 0
        y = client.combine(client.dispatch(x, idx, w, layer))
        torch.cuda.synchronize()
        diff = calc_diff(gpu_reference(ckpt, x, idx, w).cpu(), y.float().cpu())
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        samples = {"dispatch": [], "combine": [], "step_wall": []}
        for trial in range(a.warmup_trials + a.trials):
            got = {k: [] for k in samples}
            for _ in range(a.iters):
                w0 = time.perf_counter_ns()
                start.record()
                h = client.dispatch(x, idx, w, layer)
                mid.record()
                client.combine(h)
                end.record()
                end.synchronize()
                got["step_wall"].append(time.perf_counter_ns() - w0)
                got["dispatch"].append(start.elapsed_time(mid) * 1e6)  # ms -> ns
                got["combine"].append(mid.elapsed_time(end) * 1e6)
            if trial >= a.warmup_trials:
                for k in samples:
                    samples[k].append(got[k])
    finally:
        close = getattr(client, "close", None)
        if close is not None:
            try:
                close()
            except Exception as exc:
                print(f"GPU row: client close failed: {exc!r}", flush=True)
        server.stop()
    med = {k: percentile([percentile(t, 50) for t in v], 50) / 1e3 for k, v in samples.items()}
    d_bytes, c_bytes = deepep_bytes(idx.cpu(), a.hidden)
    flat = {k: [s for t in v for s in t] for k, v in samples.items()}
    print(f"\n{name}")
    print(
        f"[gpu] Dispatch: median {med['dispatch']:.2f} us, min {min(flat['dispatch']) / 1e3:.2f}"
        f" us, max {max(flat['dispatch']) / 1e3:.2f} us | Combine (incl. the server's MLP): "
        f"median {med['combine']:.2f} us, min {min(flat['combine']) / 1e3:.2f} us | step wall "
        f"median {med['step_wall']:.2f} us | calc_diff {diff:.2e}"
    )
    return {
        "name": name,
        "dispatch_us": med["dispatch"],
        "combine_us": med["combine"],
        "dispatch_gbps": d_bytes / med["dispatch"] / 1e3,
        "combine_gbps": c_bytes / med["combine"] / 1e3,
        "step_wall_us": med["step_wall"],
        "calc_diff": diff,
        "max_calc_diff": diff,
        "diff_limit": GPU_DIFF_LIMIT,
        "gpu": torch.cuda.get_device_name(dev),
        "expert_intermediate": a.gpu_intermediate,
        "samples_ns": samples,
    }
