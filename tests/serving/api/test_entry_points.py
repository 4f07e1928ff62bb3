"""The two entry points the CLI mounts, as processes: ``serve_frontend`` (blocking uvicorn) and
``python -m moecomm_serving.cli.loadgen`` against it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

START_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 120.0

SERVER = """
import sys, torch
torch.set_num_threads(1)
from moecomm_serving.api.app import FrontendSettings, serve_frontend
from moecomm_serving.model.transformer import load_model
from moecomm_serving.model.tokenizer import load_tokenizer
model = load_model(sys.argv[1], dtype=torch.float32)
serve_frontend(model, load_tokenizer(sys.argv[1], model.config), FrontendSettings("tiny", 128),
               port=int(sys.argv[2]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_frontend_and_bench_cli(tiny_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(tiny_dir), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "serve_frontend did not answer /health"
            try:
                if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        out = tmp_path / "bench.json"
        argv = ["--base-url", url, "--num-prompts", "4", "--input-len", "12", "--output-len", "3"]
        bench = subprocess.run(
            [sys.executable, "-m", "moecomm_serving.cli.loadgen", *argv, "--result-file", str(out)],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert bench.returncode == 0, bench.stdout + bench.stderr
        assert "Successful requests:" in bench.stdout
        report = json.loads(out.read_text())
        assert report["successful_requests"] == 4
        assert report["total_output_tokens"] == 12
        assert report["config"]["model"] == "tiny"
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down cleanly (engine stopped)
        try:
            proc.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(START_TIMEOUT_S)
