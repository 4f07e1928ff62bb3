"""Lists what the pinned engines call or read on DeepEP's and NIXL-EP's objects, by an AST scan
of their source (the files in FILES), and marks each against moecomm's answer.

An entry: engine, file:line, the object (the moecomm face it lands on: ``deep_ep`` /
``nixl_ep`` modules, ``deep_ep.Buffer``, ``deep_ep.ElasticBuffer``, ``nixl_ep.Buffer``, their
``EventOverlap`` / ``Config`` / ``EPHandle``), the attribute, whether it is called or read, and a
call's literal arguments (how many positional, which keywords; keywords passed only under a
condition, e.g. ``**(dict(use_nvfp4=True) if ... else dict())``, apart). Receivers are told by
name, the way these files write them (``self.buffer``, ``buffer``, ``buf``, ``state.buffer``,
``handle`` in the managers' ``get_handle``, ``Buffer`` imported from ``deep_ep``, ...); the
object behind a ``buffer`` depends on the file and, in all2all.py, on the manager class.

Status: ``answered`` when moecomm's object has the attribute and calling it on a bare instance
with stand-in arguments does not raise ``NotImplementedError``; else ``refused`` with the reason
(moecomm's message, or "absent").

    python tools/scan_engine_calls.py --site .venv/engines/site            # print the JSON
    python tools/scan_engine_calls.py --site .venv/engines/site --write     # rewrite the record
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "engines" / "engine_calls.json"
ENGINES = {"vllm": "0.33.0", "sglang": "0.5.23"}
FUSED = "vllm/model_executor/layers/fused_moe/prepare_finalize/"
DISPATCHER = "sglang/srt/layers/moe/token_dispatcher/"
FILES = {
    "vllm": [
        FUSED + "deepep_ll.py",
        FUSED + "deepep_ht.py",
        FUSED + "deepep_v2.py",
        FUSED + "nixl_ep.py",
        "vllm/distributed/device_communicators/all2all.py",
        "vllm/v1/worker/sentinel/",
    ],
    "sglang": [DISPATCHER + "deepep.py", DISPATCHER + "deepep_v2.py", DISPATCHER + "nixl.py"],
}
BUFFER_NAMES = {"self.buffer", "buffer", "buf", "state.buffer", "self._buffer"}
MODULES = {"deep_ep", "nixl_ep"}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def _family(path: str, klass: str | None) -> str:
    """Which library a buffer in this file (and class) is: deep_ep, elastic or nixl_ep."""
    if "nixl" in path or (klass and "Nixl" in klass):
        return "nixl_ep"
    if "deepep_v2" in path or (klass and "V2" in klass):
        return "elastic"
    return "deep_ep"


BUFFER_OBJECT = {"deep_ep": "deep_ep.Buffer", "elastic": "deep_ep.ElasticBuffer"}
BUFFER_OBJECT["nixl_ep"] = "nixl_ep.Buffer"


class _Scanner(ast.NodeVisitor):
    def __init__(self, engine: str, path: str) -> None:
        self.engine, self.path = engine, path
        self.klass: list[str] = []
        self.func: list[str] = []
        self.imported: dict[str, str] = {}  # local name -> "deep_ep.Buffer"
        self.entries: list[dict] = []
        self.calls: dict[int, ast.Call] = {}

    # context
    def visit_ClassDef(self, node):
        self.klass.append(node.name)
        self.generic_visit(node)
        self.klass.pop()

    def visit_FunctionDef(self, node):
        self.func.append(node.name)
        self.generic_visit(node)
        self.func.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ImportFrom(self, node):
        if node.module in MODULES:
            for alias in node.names:
                self.imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        self.generic_visit(node)

    def visit_Call(self, node):
        self.calls[id(node.func)] = node
        if isinstance(node.func, ast.Name) and node.func.id in self.imported:
            target = self.imported[node.func.id]
            self._add(node, self._object_of(target), "__init__", "call", node)
        self.generic_visit(node)

    def _object_of(self, dotted: str) -> str:
        """'deep_ep.Buffer' -> the object name used in the record."""
        module, _, name = dotted.partition(".")
        if name == "Buffer":
            return BUFFER_OBJECT["nixl_ep" if module == "nixl_ep" else "deep_ep"]
        return dotted

    def _role(self, receiver: str) -> str | None:
        klass = self.klass[-1] if self.klass else None
        family = _family(self.path, klass)
        in_managers = self.path.endswith("all2all.py")
        if in_managers and not (klass or "").startswith(("DeepEP", "NixlEP")):
            return None  # the other backends' managers (MoonEP, Mori, FlashInfer, ...)
        if receiver in MODULES:
            return receiver
        if receiver in self.imported:
            return self._object_of(self.imported[receiver])
        if receiver in {"deep_ep.Buffer", "nixl_ep.Buffer", "deep_ep.ElasticBuffer"}:
            return self._object_of(receiver)
        if receiver in BUFFER_NAMES:
            if receiver == "self._buffer" or (klass and klass.startswith("_NixlEPBufferState")):
                return None
            return BUFFER_OBJECT[family]
        if receiver == "handle":
            if in_managers:  # the managers' cached buffers ("handles")
                return BUFFER_OBJECT[family]
            if family == "elastic":
                return "deep_ep.EPHandle"
            return None
        if receiver in {"event", "previous_event"}:
            return "nixl_ep.EventOverlap" if family == "nixl_ep" else "deep_ep.EventOverlap"
        if receiver == "config" and self.path.endswith(DISPATCHER + "deepep.py"):
            return "deep_ep.Config"
        return None

    def visit_Attribute(self, node):
        receiver = _dotted(node.value)
        role = None if receiver is None else self._role(receiver)
        if role is not None:
            call = self.calls.get(id(node))
            self._add(node, role, node.attr, "call" if call else "read", call)
        self.generic_visit(node)

    def _add(self, node, obj: str, name: str, kind: str, call: ast.Call | None) -> None:
        if obj in MODULES and name in {"Buffer", "ElasticBuffer"} and kind == "read":
            pass  # the class itself, read (e.g. handed to a cache): recorded as a read
        entry = {
            "engine": self.engine,
            "file": self.path,
            "line": node.lineno,
            "object": obj,
            "name": name,
            "kind": kind,
        }
        if call is not None:
            entry["positional"] = sum(1 for a in call.args if not isinstance(a, ast.Starred))
            entry["keywords"] = sorted(k.arg for k in call.keywords if k.arg is not None)
            conditional = set()
            for k in call.keywords:
                if k.arg is None:
                    for sub in ast.walk(k.value):
                        if isinstance(sub, ast.Call) and _dotted(sub.func) == "dict":
                            conditional.update(kw.arg for kw in sub.keywords if kw.arg)
                        if isinstance(sub, ast.Dict):
                            conditional.update(
                                key.value for key in sub.keys if isinstance(key, ast.Constant)
                            )
            if conditional:
                entry["conditional_keywords"] = sorted(conditional)
            if any(k.arg is None for k in call.keywords) and not conditional:
                entry["star_kwargs"] = True
        self.entries.append(entry)


def _constructor_kwargs(engine: str, path: str, tree: ast.AST) -> list[dict]:
    """vLLM's managers build their buffers from the dict `_make_all2all_kwargs` returns
    (handle_cache.get_or_create(kwargs, deep_ep.Buffer)): its keys are the constructor's
    keywords."""
    out = []
    for klass in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        if not klass.name.startswith(("DeepEP", "NixlEP")):
            continue  # the other backends' managers
        for fn in klass.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name == "_make_all2all_kwargs"):
                continue
            for sub in ast.walk(fn):
                if isinstance(sub, ast.Call) and _dotted(sub.func) == "dict" and sub.keywords:
                    obj = BUFFER_OBJECT[_family(path, klass.name)]
                    out.append(
                        {
                            "engine": engine,
                            "file": path,
                            "line": sub.lineno,
                            "object": obj,
                            "name": "__init__",
                            "kind": "call",
                            "positional": 0,
                            "keywords": sorted(k.arg for k in sub.keywords if k.arg),
                        }
                    )
    return out


def scan(site: Path) -> list[dict]:
    entries = []
    for engine, paths in FILES.items():
        for rel in paths:
            target = site / rel
            files = sorted(target.glob("*.py")) if rel.endswith("/") else [target]
            for file in files:
                relpath = str(file.relative_to(site))
                tree = ast.parse(file.read_text(), filename=relpath)
                scanner = _Scanner(engine, relpath)
                scanner.visit(tree)
                entries += scanner.entries + _constructor_kwargs(engine, relpath, tree)
    entries.sort(key=lambda e: (e["engine"], e["file"], e["line"], e["object"], e["name"]))
    return entries


# ------------------------------------------------------------------------------ moecomm's side
def moecomm_object(obj: str):
    """The moecomm module or class an entry's object names."""
    module_name, _, attr = obj.partition(".")
    module = importlib.import_module(f"moecomm.compat.{module_name}")
    return module if not attr else getattr(module, attr)


class _Stand:
    """A stand-in argument: any use of it fails, which is not a NotImplementedError."""

    def __repr__(self) -> str:
        return "<engine argument>"


def _timeout(signum, frame):
    raise TimeoutError("took too long on a bare instance")


def status(entry: dict) -> tuple[str, str | None]:
    """('answered', None) or ('refused', reason)."""
    try:
        target = moecomm_object(entry["object"])
    except (ImportError, AttributeError) as exc:
        return "refused", f"absent: {exc}"
    name = entry["name"]
    if name == "__init__":
        return "answered", None
    if entry["object"] == "deep_ep.EPHandle":  # attributes set per instance by ElasticBuffer
        source = inspect.getsource(importlib.import_module("moecomm.compat.elastic"))
        return ("answered", None) if name in source else ("refused", "absent on EPHandle")
    if not hasattr(target, name):
        if inspect.isclass(target) and f"self.{name} =" in inspect.getsource(target):
            return "answered", None
        return "refused", f"absent: moecomm's {entry['object']} has no {name!r}"
    attr = inspect.getattr_static(target, name)
    fn = getattr(target, name)
    if entry["kind"] != "call" or not callable(fn) or isinstance(attr, property):
        return "answered", None
    bound_self = inspect.isclass(target) and not isinstance(attr, (staticmethod, classmethod))
    args = [_Stand()] * entry.get("positional", 0)
    kwargs = {k: _Stand() for k in entry.get("keywords", [])}
    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(2)
    try:
        if bound_self:
            fn(object.__new__(target), *args, **kwargs)
        else:
            fn(*args, **kwargs)
    except NotImplementedError as exc:
        return "refused", str(exc)
    except BaseException:
        pass
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return "answered", None


def record(site: Path) -> dict:
    entries = scan(site)
    for entry in entries:
        entry["status"], reason = status(entry)
        if reason is not None:
            entry["reason"] = reason
    return {"engines": ENGINES, "files": FILES, "calls": entries}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=ROOT / ".venv" / "engines" / "site")
    parser.add_argument("--write", action="store_true", help=f"rewrite {RECORD}")
    args = parser.parse_args()
    data = record(args.site)
    text = json.dumps(data, indent=1) + "\n"
    if args.write:
        RECORD.write_text(text)
        calls = data["calls"]
        refused = sum(1 for c in calls if c["status"] == "refused")
        print(f"{RECORD}: {len(calls)} entries, {refused} refused")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
