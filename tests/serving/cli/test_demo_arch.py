"""`moecomm demo --arch ...`: the whole system on a tiny checkpoint of each newer family."""

import subprocess
import sys

import pytest
from moecomm.testing import forking_env

CLI = [sys.executable, "-m", "moecomm_serving.cli"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_demo_serves_a_checkpoint_of_the_family(arch):
    # Its processes forked, as the suite's are: how the demo starts them is test_demo.py's.
    out = subprocess.run(
        [*CLI, "demo", "--arch", arch],
        capture_output=True,
        text=True,
        timeout=280,
        env=forking_env(),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert f"tiny {arch} checkpoint" in text and "demo OK" in text
    assert text.count(" -> ") == 3  # three completions
    assert "'status': 'ok'" in text  # health ran a real forward through the expert servers
    assert "failovers 0" in text
