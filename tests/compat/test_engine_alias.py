"""The opt-in engine import names (engines/alias): ``MOECOMM_AS_DEEP_EP`` / ``MOECOMM_AS_NIXL_EP``
make ``import deep_ep`` / ``import nixl_ep`` answer with moecomm.compat, in every process.

Each case runs a child Python, as an engine's worker process starts: ``site.addsitedir`` on the
package folder runs its ``moecomm_engine_alias.pth`` exactly as site-packages would at start-up.
The last test builds the wheel, installs it into a fresh virtual environment and checks a
spawned grandchild (an engine worker) sees the alias too."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALIAS_DIR = os.path.join(ROOT, "engines", "alias")
VARS = ("MOECOMM_AS_DEEP_EP", "MOECOMM_AS_NIXL_EP")
NIXL_TARGET_EXISTS = importlib.util.find_spec("moecomm.compat.nixl_ep") is not None

# What the engines do (vllm/utils/import_utils.py _has_module; SGLang's guarded import).
PROBE = """
import importlib, importlib.util, json, logging, sys
logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
{prelude}
out = {{}}
def has_module(name):  # vLLM 0.33.0's _has_module, without its cache
    try:
        if importlib.util.find_spec(name) is None:
            return False
        importlib.import_module(name)
    except Exception as exc:
        out[name + "_error"] = f"{{type(exc).__name__}}: {{exc}}"
        return False
    return True
out["before"] = "moecomm_engine_alias" in sys.modules
for name in {names!r}:
    out[name] = has_module(name)
import_real = out.get("deep_ep") and getattr(importlib.import_module("deep_ep"), "REAL", False)
if out.get("deep_ep") and not import_real:
    import deep_ep
    import moecomm.compat.deep_ep as m
    from deep_ep import Buffer, Config  # SGLang
    out["same"] = deep_ep is m and Buffer is m.Buffer and Config is m.Config
    out["spec"] = importlib.util.find_spec("deep_ep").name  # after import: deep_ep.__spec__
    out["name"] = deep_ep.__name__
    import deep_ep  # a second import: no second log line
print("RESULT " + json.dumps(out))
"""


def _child(env_vars: dict, names=("deep_ep",), pythonpath=(), prelude="", site=True):
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env.update(env_vars)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")]).strip(os.pathsep)
    pre = f"import site; site.addsitedir({ALIAS_DIR!r})\n" if site else ""
    code = pre + PROBE.format(prelude=prelude, names=list(names))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), proc.stderr


def _fake_real_deep_ep(tmp_path) -> str:
    pkg = tmp_path / "site" / "deep_ep"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = True\n")
    return str(tmp_path / "site")


def _answer_lines(stderr: str, name: str = "deep_ep") -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith(f"moecomm: `import {name}`")]


def test_pth_is_one_cheap_import_line():
    with open(os.path.join(ALIAS_DIR, "moecomm_engine_alias.pth")) as f:
        lines = f.read().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import ")
    for var in VARS:
        assert var in lines[0]
    # Without the variables, starting an interpreter does not even import the module.
    got, err = _child({}, names=())
    assert got["before"] is False and "moecomm:" not in err


def test_off_unless_asked():
    for value in (None, "", "0", "off", "false"):
        got, err = _child({} if value is None else {"MOECOMM_AS_DEEP_EP": value})
        assert got["deep_ep"] is False and "deep_ep_error" not in got, value
        assert not _answer_lines(err)


def test_deep_ep_answered_by_moecomm_with_one_log_line():
    got, err = _child({"MOECOMM_AS_DEEP_EP": "1"})
    assert got["before"] is True
    assert got["deep_ep"] is True, got
    assert got["same"] is True
    assert got["spec"] == got["name"] == "moecomm.compat.deep_ep"
    lines = _answer_lines(err)
    assert len(lines) == 1, err
    assert "moecomm.compat.deep_ep" in lines[0] and "MOECOMM_AS_DEEP_EP=1" in lines[0]
    logged = [x for x in err.splitlines() if x.startswith("LOG moecomm.engine_alias")]
    assert len(logged) == 1 and "answered by moecomm.compat.deep_ep" in logged[0]


def test_a_real_deep_ep_is_not_shadowed_unless_forced(tmp_path):
    real = _fake_real_deep_ep(tmp_path)
    got, err = _child({"MOECOMM_AS_DEEP_EP": "1"}, pythonpath=[real])
    assert got["deep_ep"] is False
    msg = got["deep_ep_error"]
    assert msg.startswith("ImportError") and real in msg and "MOECOMM_AS_DEEP_EP=force" in msg
    assert not _answer_lines(err)
    # Without the variable the real one is found as usual.
    got, _ = _child({}, pythonpath=[real], prelude="import deep_ep; assert deep_ep.REAL")
    assert got["deep_ep"] is True
    # force: moecomm answers, and says what it shadows.
    got, err = _child({"MOECOMM_AS_DEEP_EP": "force"}, pythonpath=[real])
    assert got["deep_ep"] is True and got["same"] is True
    (line,) = _answer_lines(err)
    assert "MOECOMM_AS_DEEP_EP=force" in line and f"shadowing the real deep_ep at {real}" in line


def test_a_bad_value_is_refused_by_name():
    got, _ = _child({"MOECOMM_AS_DEEP_EP": "please"})
    assert got["deep_ep"] is False
    assert "MOECOMM_AS_DEEP_EP='please'" in got["deep_ep_error"]


def test_nixl_ep_alias():
    got, err = _child({"MOECOMM_AS_NIXL_EP": "1"}, names=("nixl_ep", "deep_ep"))
    assert got["deep_ep"] is False  # only what was asked for
    if NIXL_TARGET_EXISTS:
        assert got["nixl_ep"] is True, got
        assert len(_answer_lines(err, "nixl_ep")) == 1
    else:
        assert got["nixl_ep"] is False
        msg = got["nixl_ep_error"]
        assert msg.startswith("ModuleNotFoundError") and "moecomm.compat.nixl_ep" in msg


def test_a_missing_target_is_a_clear_import_error():
    prelude = (
        "import moecomm_engine_alias as a\n"
        "a.install({'nixl_ep': 'on'}, targets={'nixl_ep': 'moecomm.compat._no_such_module'})"
    )
    got, _ = _child({}, names=("nixl_ep",), prelude=prelude)
    msg = got["nixl_ep_error"]
    assert msg.startswith("ModuleNotFoundError")
    assert "MOECOMM_AS_NIXL_EP is set" in msg and "moecomm.compat._no_such_module" in msg


def test_install_api_in_process(monkeypatch, capsys):
    monkeypatch.syspath_prepend(ALIAS_DIR)
    import moecomm_engine_alias as alias

    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    assert alias.modes_from_env() == {}
    assert alias.modes_from_env({"MOECOMM_AS_DEEP_EP": "Force", "MOECOMM_AS_NIXL_EP": "yes"}) == {
        "deep_ep": "force",
        "nixl_ep": "on",
    }
    assert alias.install() is None and alias.installed() is None
    with pytest.raises(ValueError, match="no moecomm alias"):
        alias.install({"deep_gemm": "on"})
    try:
        finder = alias.install({"deep_ep": "on"})
        assert sys.meta_path[0] is finder and alias.installed() is finder
        assert finder.find_spec("deep_ep.utils", ["x"]) is None  # submodules: not ours
        assert finder.find_spec("nixl_ep") is None  # not asked for
        spec = finder.find_spec("deep_ep")
        assert spec.name == "deep_ep" and spec.origin.endswith("deep_ep.py")
        alias.install({"deep_ep": "force"})  # replaces, never stacks
        assert sum(isinstance(f, alias.AliasFinder) for f in sys.meta_path) == 1
    finally:
        alias.uninstall()
    assert alias.installed() is None
    # startup() never raises: a failure is one stderr line.
    monkeypatch.setenv("MOECOMM_AS_DEEP_EP", "1")
    monkeypatch.setattr(alias, "install", lambda: 1 / 0)
    monkeypatch.setattr(alias, "_startup_failed", False)
    alias.startup()
    alias.startup()
    assert alias.installed() is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "were not installed: ZeroDivisionError" in err[0]


@pytest.mark.timeout(300)
def test_installed_wheel_reaches_spawned_workers(tmp_path):
    """pip builds the wheel (the .pth at its root), installs it into a fresh environment, and a
    worker spawned by a process of that environment imports deep_ep from moecomm."""
    wheels, src = tmp_path / "wheels", tmp_path / "src"
    # A copy: setuptools builds in the source folder (build/, *.egg-info).
    shutil.copytree(ALIAS_DIR, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*build, "--no-index", "-w", str(wheels), str(src)],
        check=True,
        capture_output=True,
        timeout=240,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("moecomm_engine_alias-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "moecomm_engine_alias.pth" in names and "moecomm_engine_alias.py" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site_dir = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*install, "--target", site_dir, str(wheel)], check=True, timeout=120)
    # This environment sees the test's own (torch, moecomm) through one more site dir.
    ours = next(p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p))
    with open(os.path.join(site_dir, "zz_parent_env.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({ours!r})\n")
    code = textwrap.dedent(
        """
        import multiprocessing as mp
        import sys

        def worker(q):
            import deep_ep
            import moecomm.compat.deep_ep as m
            q.put((deep_ep.Buffer is m.Buffer, "moecomm_engine_alias" in sys.modules))

        if __name__ == "__main__":
            import importlib.util
            assert importlib.util.find_spec("deep_ep") is not None
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=worker, args=(q,))
            p.start()
            print("WORKER", q.get(timeout=120))
            p.join(30)
        """
    )
    script = tmp_path / "engine.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in (*VARS, "PYTHONPATH")}
    env["MOECOMM_AS_DEEP_EP"] = "1"
    proc = subprocess.run(
        [py, str(script)], env=env, capture_output=True, text=True, timeout=200, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "WORKER (True, True)" in proc.stdout, proc.stdout + proc.stderr
    # The spawned worker imported deep_ep too: its own log line, with its own pid.
    assert len(_answer_lines(proc.stderr)) == 1, proc.stderr
