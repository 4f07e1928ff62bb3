"""tools/check_imports.py: the tree has no import circle, and the check finds the circles it must.

The synthetic trees are built in tmp_path with the layout the tool reads (python/, bench/).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "check_imports.py"


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_tree_has_no_import_circle_and_no_private_name_across_modules():
    res = check(REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no circle" in res.stdout


def test_a_lazy_import_back_is_a_circle_and_a_type_checking_import_is_not(tmp_path):
    write(
        tmp_path,
        {
            "python/pkg/__init__.py": "from pkg.kernels import run\n",
            "python/pkg/kernels.py": """\
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from pkg.typed import Hint  # never runs: not an edge

                def run(ws=None):
                    from pkg.workspace import step  # lazy, and still an edge

                    return step()
                """,
            "python/pkg/workspace.py": "from pkg.kernels import run\n\ndef step(): ...\n",
            "python/pkg/typed.py": "from pkg.kernels import run\n\nclass Hint: ...\n",
        },
    )
    res = check(tmp_path)
    assert res.returncode == 1
    out = res.stdout
    assert "import circle 1 (2 modules): pkg.kernels, pkg.workspace" in out
    assert "python/pkg/kernels.py:7: pkg.kernels -> pkg.workspace (lazy, inside a function)" in out
    assert "python/pkg/workspace.py:1: pkg.workspace -> pkg.kernels" in out
    assert "pkg.typed" not in out  # the TYPE_CHECKING import closes no circle
    assert "import circle 2" not in out


def test_parent_packages_compiled_modules_and_script_folders(tmp_path):
    write(
        tmp_path,
        {
            # pkg/__init__ -> pkg.sub, and pkg.sub imports pkg.other (pkg/__init__ runs first, an
            # implicit parent import) and the compiled pkg._C, which __init__ does not bind.
            "python/pkg/__init__.py": "from pkg.sub import f\nfrom . import other\n",
            "python/pkg/sub.py": "import pkg.other\nfrom pkg import _C\n\ndef f(): ...\n",
            "python/pkg/other.py": "from ._C import thing\n",
            # Script folders import by bare name; their modules are distinct from packages'.
            "bench/common.py": "import json\n",
            "bench/row.py": "from common import json\n",
        },
    )
    res = check(tmp_path)
    assert res.returncode == 0, res.stdout
    # A name that pkg/__init__ does bind is an edge to it: pkg -> sub -> other -> pkg is real.
    write(tmp_path, {"python/pkg/other.py": "from pkg import f\n"})
    res = check(tmp_path)
    assert res.returncode == 1
    assert "import circle 1 (3 modules): pkg, pkg.other, pkg.sub" in res.stdout
    # Script folders: a lazy import back between two bench scripts.
    write(
        tmp_path,
        {
            "python/pkg/other.py": "\n",
            "bench/common.py": "def helper():\n    import row\n",
        },
    )
    res = check(tmp_path)
    assert res.returncode == 1
    assert "import circle 1 (2 modules): bench/common, bench/row" in res.stdout


def test_private_names_across_wire_modules_fail(tmp_path):
    write(
        tmp_path,
        {
            "python/moecomm/__init__.py": "",
            "python/moecomm/wire/__init__.py": "",
            "python/moecomm/wire/channel.py": "_HEADER = 8\nPUBLIC = 1\n\ndef _pack(): ...\n",
            "python/moecomm/wire/client.py": """\
                from moecomm.wire import channel
                from moecomm.wire.channel import PUBLIC, _HEADER

                def send():
                    return channel._pack(), channel.__name__, PUBLIC, _HEADER
                """,
            # Outside the checked packages a private import is not this check's business.
            "python/moecomm/other.py": "from moecomm.wire.channel import _HEADER\n",
        },
    )
    res = check(tmp_path)
    assert res.returncode == 1
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("private name")]
    assert lines == [
        "private name: python/moecomm/wire/client.py:2: "
        "moecomm.wire.client uses moecomm.wire.channel._HEADER",
        "private name: python/moecomm/wire/client.py:5: "
        "moecomm.wire.client uses moecomm.wire.channel._pack",
    ]
