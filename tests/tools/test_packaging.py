"""`pip install .` without extras gives a working library: `moecomm`, its DeepEP face
(`moecomm.compat.deep_ep`) and the runtime import with the library's own dependencies alone.

Checked without building a wheel (minutes on 2 cores): pyproject's core dependencies must each be
imported by the library (`python/moecomm`) and none may be one of the serving extra's; and a
fresh interpreter whose import system refuses every module of the serving-only distributions
(the `serving` extra's, and what they alone pull in) and `moecomm_serving` must import the
library without even trying one of them. The same interpreter then imports a refused module
and `moecomm_serving`, which must fail: the refusal works.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency provides it
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "python" / "moecomm"
# What `pip install .` must be able to import: the library, the face engines import, the runtime.
MUST_IMPORT = ("moecomm", "moecomm.compat.deep_ep", "moecomm.runtime")
# A fresh interpreter imports torch: seconds on a loaded 2-core machine, well inside this.
CHILD_TIMEOUT_S = 120.0

CHILD = r"""
import importlib, json, pkgutil, sys

refused = set(json.loads(sys.argv[1]))
must = json.loads(sys.argv[2])
control = sys.argv[3:]
tried = []


def importer():
    "The module whose code runs the import statement (the first frame outside importlib)."
    frame = sys._getframe(2)
    while frame is not None and "importlib" in frame.f_code.co_filename:
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"


class Refuse:
    "Acts as if the refused modules were not installed; notes who tried each."

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in refused:
            tried.append([name, importer()])
            raise ModuleNotFoundError(f"No module named {name!r} (refused)", name=name)
        return None


def load(name, errors):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        errors[name] = str(exc)
        return None


preloaded = sorted(m for m in sys.modules if m.partition(".")[0] in refused)
sys.meta_path.insert(0, Refuse())
errors = {}
for name in must:
    load(name, errors)
runtime = sys.modules.get("moecomm.runtime")  # asked for: every module of it too
for info in pkgutil.iter_modules(runtime.__path__ if runtime else []):
    load("moecomm.runtime." + info.name, errors)
library = [t for t in tried if t[1].partition(".")[0] == "moecomm"]
others = [t for t in tried if t not in library]
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in refused)
imported = sorted(m for m in sys.modules if m.startswith("moecomm"))
refusals = {}
for name in control:
    load(name, refusals)
print(json.dumps({"preloaded": preloaded, "errors": errors, "library": library, "others": others,
                  "loaded": loaded, "imported": imported, "refusals": refusals}))
"""


def import_refusing(refused: set[str], must: tuple[str, ...], control: tuple[str, ...] = ()):
    """Runs CHILD in a fresh interpreter: imports `must` (with moecomm.runtime, every module of
    it) with the `refused` modules refused, then tries each of `control`; its report."""
    r = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(sorted(refused)), json.dumps(must), *control],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert r.returncode == 0, f"the import check itself failed:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement string (PEP 503)."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert m, f"cannot read a distribution name from {requirement!r}"
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def core_dependencies() -> set[str]:
    return {_name(r) for r in _pyproject()["dependencies"]}


def serving_dependencies() -> set[str]:
    return {_name(r) for r in _pyproject()["optional-dependencies"]["serving"]}


def _modules_of() -> dict[str, set[str]]:
    """{distribution: its top-level modules} for what is installed here."""
    out: dict[str, set[str]] = {}
    for module, dists in md.packages_distributions().items():
        for d in dists:
            out.setdefault(_name(d), set()).add(module)
    return out


def _closure(names: set[str]) -> set[str]:
    """`names` and every distribution they require (unconditionally), as far as installed."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if not re.search(r"\bextra\s*==", r)]
    return seen


def serving_only_modules() -> set[str]:
    """Top-level modules of the serving extra's distributions, of what only they pull in (not
    also a core dependency's requirement), and the serving package itself."""
    only = serving_dependencies() | (
        _closure(serving_dependencies()) - _closure(core_dependencies())
    )
    modules_of = _modules_of()
    out = {"moecomm_serving"}
    for dist in only:
        out |= modules_of.get(dist, {dist.replace("-", "_")})
    return out


def library_imports() -> set[str]:
    """Top-level names every module of python/moecomm imports (lazy imports included)."""
    out = set()
    for path in LIBRARY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out |= {a.name.partition(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.add(node.module.partition(".")[0])
    return out


def test_every_core_dependency_is_the_librarys_own():
    """No core dependency is a serving one: each is imported by python/moecomm itself, and none
    is also in the serving extra."""
    core, serving = core_dependencies(), serving_dependencies()
    assert core and serving, "pyproject lists no core or no serving dependencies"
    assert not core & serving, f"in both the core and the serving extra: {sorted(core & serving)}"
    used, modules_of = library_imports(), _modules_of()
    unused = sorted(
        dist for dist in core if not modules_of.get(dist, {dist.replace("-", "_")}) & used
    )
    assert not unused, f"core dependencies python/moecomm never imports: {unused}"


def test_the_library_imports_with_the_serving_only_modules_refused():
    refused = serving_only_modules()
    assert {"tokenizers", "jinja2", "moecomm_serving"} <= refused, sorted(refused)
    control = ("tokenizers", "jinja2", "moecomm_serving")
    got = import_refusing(refused, MUST_IMPORT, control)
    assert not got["preloaded"], f"imported before the hook was in place: {got['preloaded']}"
    assert not got["errors"], f"the library failed to import: {got['errors']}"
    # (module, importer): only the library's own attempts count; a dependency's optional import
    # (torch.hub tries tqdm) falls back as it does where the module is not installed.
    assert not got["library"], f"the library tried serving-only modules: {got['library']}"
    assert not got["loaded"], f"serving-only modules imported: {got['loaded']}"
    assert set(MUST_IMPORT) | {"moecomm.runtime.placement"} <= set(got["imported"])
    # The refusal is real: the same interpreter cannot import them.
    assert sorted(got["refusals"]) == sorted(control), got["refusals"]


def test_the_check_names_a_library_import_of_a_refused_module():
    """The check can fail: refuse a module the library does import (httpx, the membership
    client's HTTP) and the attempt is named with the library module that made it. (A module
    that needs no torch: this interpreter starts in a fraction of a second.)"""
    got = import_refusing({"httpx"}, ("moecomm.membership.embedded",))
    assert got["errors"], "the membership client imported without httpx"
    assert any(mod == "httpx" and who.startswith("moecomm.") for mod, who in got["library"]), got[
        "library"
    ]
