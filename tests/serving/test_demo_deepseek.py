"""`moecomm demo --arch deepseek_v3`: the whole system on a tiny DeepSeek-V3 checkpoint."""

import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "moecomm_serving.cli"]


@pytest.mark.timeout(300)
def test_demo_serves_a_deepseek_v3_checkpoint():
    out = subprocess.run(
        [*CLI, "demo", "--arch", "deepseek_v3"], capture_output=True, text=True, timeout=280
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "tiny deepseek_v3 checkpoint" in text and "demo OK" in text
    assert text.count(" -> ") == 3  # three completions
    assert "'status': 'ok'" in text  # health ran a real forward through the expert servers
    assert "failovers 0" in text
