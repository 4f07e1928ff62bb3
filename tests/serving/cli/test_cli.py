"""The `moecomm` command as a user runs it: real subprocesses on 127.0.0.1."""

import signal
import subprocess

import httpx
import pytest
from moecomm.testing import CLI_ARGV, Processes
from moecomm_serving.cli.expert_server import parse_ids
from moecomm_serving.model.config import MoEConfig

CLI = list(CLI_ARGV)


def test_help_explains_every_subcommand():
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for cmd in ("monitor", "expert-server", "tiny"):
        assert cmd in out.stdout
    es = subprocess.run(
        [*CLI, "expert-server", "--help"], capture_output=True, text=True, timeout=60
    )
    assert "--checkpoint" in es.stdout and "--monitor" in es.stdout


def test_parse_ids():
    assert parse_ids("all", 4, "x") == [0, 1, 2, 3]
    assert parse_ids("0-2,5", 8, "x") == [0, 1, 2, 5]
    with pytest.raises(SystemExit, match="outside"):
        parse_ids("3-9", 8, "--experts")
    with pytest.raises(SystemExit, match="cannot parse"):
        parse_ids("a-b", 8, "--experts")


@pytest.mark.timeout(300)
def test_monitor_and_expert_server_from_the_command_line(tmp_path):
    ckpt = tmp_path / "tiny"
    subprocess.run([*CLI, "tiny", "--out", str(ckpt)], check=True, timeout=120, capture_output=True)
    with Processes(tmp_path / "procs") as procs:
        monitor_url = procs.moecomm("monitor", ["monitor"]).url
        es = procs.moecomm(
            "expert-server",
            [
                "expert-server",
                "--checkpoint",
                str(ckpt),
                "--layers",
                "0-1",
                "--experts",
                "0-3",
                "--monitor",
                monitor_url,
                "--ttl",
                "1",
            ],
        )
        url = es.url
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["ok"]
        experts = httpx.get(f"{url}/experts", timeout=10).json()["layers"]
        assert experts == {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]}
        members = httpx.get(f"{monitor_url}/members", timeout=10).json()["members"]
        assert [m["member"]["endpoints"]["control"] for m in members] == [url]
        # SIGTERM drains: the server answers DRAINING, waits for traffic to stop, then leaves.
        es.send_signal(signal.SIGTERM)
        assert es.popen.wait(60) == 0
        assert "draining" in es.output()
        # A clean exit deregisters at once (no waiting for the lease).
        members = httpx.get(f"{monitor_url}/members", timeout=10).json()["members"]
        assert members == []


@pytest.mark.parametrize(("flag", "arch"), [("--arch", "qwen3_moe"), ("--layout", "qwen2_moe")])
def test_tiny_writes_the_chosen_family(tmp_path, flag, arch):
    """`moecomm tiny --arch A` writes a checkpoint of family A; `--layout` is its old name."""
    ckpt = tmp_path / "tiny"
    out = subprocess.run(
        [*CLI, "tiny", "--out", str(ckpt), flag, arch], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"tiny {arch} checkpoint" in out.stdout
    assert MoEConfig.from_file(ckpt).model_type == arch
