"""Which GPU test files the GPU check (tools/gpu_check.py) runs in each test stage: the files
that apply the gpu marker in code, found by parsing them, placed by gpu_check_plan's stage
lists, with every marked file in no stage run by core. Standard library only: it runs before
anything is installed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gpu_check_plan import CONDITIONAL_FILES, STAGE_FILES, UNPLANNED_CAP_S, stage_of

GPU_MARK = re.compile(r"\bmark\.gpu\b")


def uses_gpu_marker(source: str) -> bool:
    """Whether Python source applies the gpu marker in code (``@pytest.mark.gpu``,
    ``pytestmark = [pytest.mark.gpu, ...]``, ``marks=mark.gpu``), not in a string or comment."""
    if not GPU_MARK.search(source):
        return False
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True  # pytest will report it; the stage runs the file and shows the error
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "gpu"
        and (
            (isinstance(node.value, ast.Attribute) and node.value.attr == "mark")
            or (isinstance(node.value, ast.Name) and node.value.id == "mark")
        )
        for node in ast.walk(tree)
    )


def discover_gpu_files(root: Path) -> list[str]:
    """Every test file that uses the gpu marker (what `pytest -m gpu` would select from)."""
    found = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        try:
            if uses_gpu_marker(path.read_text(errors="replace")):
                found.append(path.relative_to(root).as_posix())
        except OSError:
            continue
    return found


def stage_files(root: Path, stage: str) -> list[tuple[str, float]]:
    """(file, cap) of a test stage, in the order they run: its planned files that exist, then
    its conditional ones (gpu_check_plan.CONDITIONAL_FILES); core also gets every gpu-marked
    file that is in no stage (UNPLANNED_CAP_S each), so a new file still runs."""
    found = discover_gpu_files(root)
    files = [(f, cap) for f, cap in STAGE_FILES.get(stage, {}).items() if f in found]
    files += [(f, c[1]) for f, c in CONDITIONAL_FILES.items() if c[0] == stage and f in found]
    if stage == "core":
        files += [(f, UNPLANNED_CAP_S) for f in found if stage_of(f) is None]
    return files


def core_files(root: Path) -> list[str]:
    return [f for f, _ in stage_files(root, "core")]
