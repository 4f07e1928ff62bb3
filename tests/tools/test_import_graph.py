"""tools/check_imports.py: the tree has no import circle and no upward import between layers,
and the check finds the circles and upward imports it must. The layers' promises kept at run
time: the router imports no torch and no model code, ``import moecomm`` no serving code (each
checked in a fresh interpreter).

The synthetic trees are built in tmp_path with the layout the tool reads (python/, serving/,
bench/).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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
    assert "no circle" in res.stdout and "no upward import" in res.stdout


def fresh_import(module: str) -> set[str]:
    """The modules a fresh interpreter holds after importing `module`."""
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert res.returncode == 0, res.stderr
    return set(res.stdout.split())


def test_the_router_imports_no_torch_and_no_model_code():
    loaded = fresh_import("moecomm_serving.disagg.router")
    assert "moecomm_serving.disagg.router" in loaded  # the check looks at the right process
    heavy = sorted(
        m
        for m in loaded
        if m == "torch"
        or m.startswith("torch.")
        or m.startswith(("moecomm_serving.model", "moecomm_serving.engine", "moecomm_serving.kv"))
    )
    assert not heavy, f"the router process loads {heavy}"


HEAVY_PREFIXES = ("moecomm_serving.engine", "moecomm_serving.kv")


def run_fresh(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    code += "\nimport sys; print(' '.join(sorted(sys.modules)))"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert res.returncode == 0, res.stderr
    return set(res.stdout.split())


def test_the_router_command_loads_no_torch():
    # what `moecomm router ...` runs before serving: the whole parser, the router's options
    # parsed, its run function found, and the config and tokenizer readers its run calls
    loaded = run_fresh(
        "from moecomm_serving.cli.main import build_parser\n"
        "args = build_parser().parse_args(['router', '--checkpoint', 'c', "
        "'--prefill', 'http://p', '--decode', 'http://d'])\n"
        "assert args.func.__module__ == 'moecomm_serving.cli.router', args.func\n"
        "import moecomm_serving.model.config, moecomm_serving.model.tokenizer\n"
    )
    assert "moecomm_serving.cli.router" in loaded  # the check looks at the right process
    heavy = sorted(m for m in loaded if m == "torch" or m.startswith(("torch.", *HEAVY_PREFIXES)))
    assert not heavy, f"the router command loads {heavy}"
    # and no other command's module: each is imported only when it is parsed
    others = {"frontend", "expert_server", "demo", "rebalance", "loadgen"}
    assert not {f"moecomm_serving.cli.{o}" for o in others} & loaded


def test_building_the_cli_parser_imports_no_command():
    loaded = run_fresh("from moecomm_serving.cli.main import build_parser\nbuild_parser()\n")
    assert "moecomm_serving.cli.main" in loaded
    commands = sorted(
        m
        for m in loaded
        if m.startswith("moecomm_serving.cli.") and m not in ("moecomm_serving.cli.main",)
    )
    assert not commands and "torch" not in loaded, commands


def test_the_library_imports_no_serving_code():
    for module in ("moecomm", "moecomm.compat.deep_ep"):
        loaded = fresh_import(module)
        serving = sorted(m for m in loaded if m.split(".")[0] == "moecomm_serving")
        assert not serving, f"import {module} loads {serving}"


def test_an_upward_import_between_layers_is_reported(tmp_path):
    write(
        tmp_path,
        {
            "python/moecomm/__init__.py": "",
            # the library importing the serving layer: upward
            "python/moecomm/wire.py": "def f():\n    import moecomm_serving.types\n",
            "serving/moecomm_serving/__init__.py": "",
            "serving/moecomm_serving/types.py": "from moecomm import wire\n",  # down: fine
            "serving/moecomm_serving/kv/__init__.py": "",
            # kv is below the model: an import of it is upward
            "serving/moecomm_serving/kv/cache.py": "from moecomm_serving.model.layer import f\n",
            "serving/moecomm_serving/model/__init__.py": "",
            "serving/moecomm_serving/model/layer.py": "from moecomm_serving.kv import cache\n",
            "serving/moecomm_serving/api/__init__.py": "",
            "serving/moecomm_serving/api/app.py": """\
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from moecomm_serving.disagg.routes import PdRoutes  # never runs: fine

                from moecomm_serving.model import layer  # down: fine

                def make():
                    from moecomm_serving.disagg.routes import PdRoutes  # lazy and upward

                    return PdRoutes
                """,
            "serving/moecomm_serving/disagg/__init__.py": "",
            "serving/moecomm_serving/disagg/routes.py": "from moecomm_serving.api import app\n",
        },
    )
    res = check(tmp_path)
    assert res.returncode == 1
    lines = sorted(ln for ln in res.stdout.splitlines() if ln.startswith("upward import"))
    assert lines == [
        "upward import: python/moecomm/wire.py:2: moecomm.wire -> moecomm_serving.types "
        "(lazy, inside a function) (moecomm below moecomm_serving.types)",
        "upward import: serving/moecomm_serving/api/app.py:9: moecomm_serving.api.app -> "
        "moecomm_serving.disagg.routes (lazy, inside a function) "
        "(moecomm_serving.api below moecomm_serving.disagg)",
        "upward import: serving/moecomm_serving/kv/cache.py:1: moecomm_serving.kv.cache -> "
        "moecomm_serving.model.layer (moecomm_serving.kv below moecomm_serving.model)",
    ]


def test_a_lazy_import_back_is_a_circle_and_so_is_a_type_checking_one(tmp_path):
    write(
        tmp_path,
        {
            "python/pkg/__init__.py": "from pkg.kernels import run\n",
            "python/pkg/kernels.py": """\
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from pkg.typed import Hint  # never runs, still a dependency

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
    # kernels names typed's class for its hints and typed imports kernels: that closes a circle
    # too (type only), one component with the lazy one.
    assert "import circle 1 (3 modules): pkg.kernels, pkg.typed, pkg.workspace" in out
    assert "python/pkg/kernels.py:4: pkg.kernels -> pkg.typed (type only)" in out
    assert "python/pkg/kernels.py:7: pkg.kernels -> pkg.workspace (lazy, inside a function)" in out
    assert "python/pkg/workspace.py:1: pkg.workspace -> pkg.kernels" in out
    assert "python/pkg/typed.py:1: pkg.typed -> pkg.kernels" in out
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
