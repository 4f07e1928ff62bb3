"""The record of what the pinned engines call on DeepEP's and NIXL-EP's objects
(engine_calls.json, made by tools/scan_engine_calls.py): that it still matches the installed
engines' source, and that every call marked answered is on moecomm's object with a signature that
binds the engine's literal arguments."""

from __future__ import annotations

import importlib.util
import inspect
import json

import engine_env
import pytest
from engine_checks import engines_or_skip

SCANNER = engine_env.ROOT / "tools" / "scan_engine_calls.py"
_spec = importlib.util.spec_from_file_location("scan_engine_calls", SCANNER)
scan_engine_calls = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scan_engine_calls)

RECORD = json.loads(scan_engine_calls.RECORD.read_text())
ANSWERED = [c for c in RECORD["calls"] if c["status"] == "answered"]
SCANNED_FIELDS = ("engine", "file", "line", "object", "name", "kind", "positional", "keywords")


def _key(entry: dict) -> tuple:
    fields = (*SCANNED_FIELDS, "conditional_keywords", "star_kwargs")
    return tuple(json.dumps(entry.get(f), sort_keys=True) for f in fields)


def _describe(entry: dict) -> str:
    args = f"({entry.get('positional', 0)} positional, keywords {entry.get('keywords', [])})"
    call = args if entry["kind"] == "call" else "(read)"
    return f"{entry['file']}:{entry['line']} {entry['object']}.{entry['name']} {call}"


def test_the_record_matches_the_installed_engines():
    """Fails, naming them, when the pinned engines' calls change (a new pin, a patched file)."""
    engines_or_skip()
    scanned = scan_engine_calls.scan(engine_env.site_dir())
    recorded = {_key(c): c for c in RECORD["calls"]}
    now = {_key(c): c for c in scanned}
    new = [_describe(now[k]) for k in now if k not in recorded]
    gone = [_describe(recorded[k]) for k in recorded if k not in now]
    assert not new and not gone, (
        "the engines' calls on deep_ep / nixl_ep changed; review them and rerun "
        "`python tools/scan_engine_calls.py --write`\n  new:\n    "
        + "\n    ".join(new or ["-"])
        + "\n  vanished:\n    "
        + "\n    ".join(gone or ["-"])
    )


def test_the_record_covers_every_scanned_file_and_pin():
    assert RECORD["engines"] == scan_engine_calls.ENGINES
    assert RECORD["files"] == scan_engine_calls.FILES
    files = {c["file"] for c in RECORD["calls"]}
    for _engine, paths in scan_engine_calls.FILES.items():
        for path in paths:
            assert any(f.startswith(path) for f in files) or path.endswith("/"), path


def test_refused_calls_say_why():
    for call in RECORD["calls"]:
        if call["status"] == "refused":
            assert call.get("reason"), _describe(call)


@pytest.mark.parametrize("call", ANSWERED, ids=[_describe(c) for c in ANSWERED])
def test_answered_call_binds_on_moecomm(call):
    target = scan_engine_calls.moecomm_object(call["object"])
    state, reason = scan_engine_calls.status(call)
    assert state == "answered", f"{_describe(call)} is recorded answered, now: {reason}"
    if call["kind"] != "call" or call["object"] == "deep_ep.EPHandle":
        return
    name = call["name"]
    args = [object()] * call.get("positional", 0)
    kwargs = {k: object() for k in call.get("keywords", [])}
    if name == "__init__":
        signature = inspect.signature(target)
    else:
        attr = inspect.getattr_static(target, name)
        fn = getattr(target, name)
        if not callable(fn):
            pytest.fail(f"{_describe(call)}: moecomm's {name} is not callable")
        signature = inspect.signature(fn)
        plain = inspect.isclass(target) and not isinstance(attr, (staticmethod, classmethod))
        if plain:
            args = [object(), *args]  # self
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        pytest.fail(f"{_describe(call)} does not bind {signature}: {exc}")
