"""One error family: every exception class moecomm and moecomm_serving define derives from
MoecommError, is named ...Error, shadows no builtin, and is listed in docs/errors.md with its
bases and a module it is importable from."""

from __future__ import annotations

import builtins
import importlib
import inspect
import re
import warnings
from pathlib import Path

import moecomm
import moecomm._C
import moecomm.errors
import moecomm_serving
import pytest
from moecomm.errors import DeadlineExceededError, MoecommError
from moecomm.wire.cuda import GpuUnavailableError

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"

# Top-level packages that exist only where CUDA does: a module importing one of them cannot be
# imported on a host without a GPU stack, and is skipped (reported) rather than failed.
GPU_ONLY_PACKAGES = {"cuda", "triton", "nvshmem"}
# Engines an engine plug-in (moecomm.engines.*) imports at module level: present only in the
# engine environment (tools/engines_env.sh), where tests/engines imports those modules.
ENGINE_PACKAGES = {"vllm", "sglang"}


def _module_names() -> list[str]:
    """Every module of both packages, from their files (importing nothing)."""
    names = []
    for pkg in (moecomm, moecomm_serving):
        root = Path(pkg.__file__).parent
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join((pkg.__name__, *parts)))
    return names


MODULES = _module_names()


def _import(name: str):
    """The module, or pytest.skip naming the missing GPU piece; any other failure fails."""
    try:
        return importlib.import_module(name)
    except GpuUnavailableError as exc:
        pytest.skip(f"{name} needs a GPU: {exc}")
    except ImportError as exc:
        if (exc.name or "").split(".")[0] in GPU_ONLY_PACKAGES:
            pytest.skip(f"{name} needs {exc.name}, which exists only with CUDA")
        if (exc.name or "").split(".")[0] in ENGINE_PACKAGES:
            pytest.skip(f"{name} is an engine plug-in: it needs {exc.name} (tests/engines)")
        raise


def _defined_errors(module) -> dict[str, type]:
    """The exception classes `module` itself defines (not those it imports)."""
    return {
        name: obj
        for name, obj in vars(module).items()
        if inspect.isclass(obj)
        and issubclass(obj, BaseException)
        and obj.__module__ == module.__name__
    }


def _native_errors() -> dict[str, type]:
    """The exception classes moecomm._C creates (their __module__ is "moecomm")."""
    return {
        name: obj
        for name, obj in vars(moecomm._C).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException)
    }


def _doc_rows() -> dict[str, tuple[list[str], str]]:
    """docs/errors.md's main table: {error: ([base names], module it is importable from)}."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not re.fullmatch(r"`\w+Error`", cells[0]):
            continue
        name = cells[0].strip("`")
        assert name not in rows, f"docs/errors.md lists {name} twice"
        rows[name] = (re.findall(r"`(\w+)`", cells[1]), cells[2].strip("`"))
    return rows


@pytest.mark.parametrize("name", MODULES)
def test_module_errors_are_in_the_family(name):
    """Every exception class a module defines is a MoecommError named ...Error, not a
    builtin's name, and docs/errors.md says where to import it from."""
    module = _import(name)
    rows = _doc_rows()
    for cls_name, cls in _defined_errors(module).items():
        where = f"{name}.{cls_name}"
        assert issubclass(cls, MoecommError), f"{where} is not a MoecommError"
        assert cls_name.endswith("Error"), f"{where}: an error's name ends in Error"
        assert not hasattr(builtins, cls_name), f"{where} shadows the builtin {cls_name}"
        assert cls_name in rows, f"{where} is missing from docs/errors.md"


@pytest.mark.parametrize("name", MODULES)
def test_no_module_shadows_a_builtin_exception(name):
    """No module binds a builtin exception's name to something else: `from moecomm.errors
    import TimeoutError` made every `except TimeoutError` in a module mean another class."""
    module = _import(name)
    for attr, value in vars(module).items():
        builtin = getattr(builtins, attr, None)
        if inspect.isclass(builtin) and issubclass(builtin, BaseException):
            assert value is builtin, f"{name}.{attr} shadows the builtin {attr}"


def test_native_errors_are_in_the_family():
    native = _native_errors()
    assert {"MoecommError", "DeadlineExceededError", "PeerLostError"} <= set(native)
    for cls_name, cls in native.items():
        assert issubclass(cls, MoecommError), cls_name
        assert cls_name.endswith("Error"), cls_name
        assert not hasattr(builtins, cls_name), f"moecomm._C.{cls_name} shadows the builtin"
    assert issubclass(DeadlineExceededError, builtins.TimeoutError)


def test_docs_table_is_true():
    """Each row of docs/errors.md names an existing error with its real bases, importable from
    the module the row gives; and every error the code defines has a row."""
    rows = _doc_rows()
    assert rows, "docs/errors.md has no error table"
    for name, (bases, where) in rows.items():
        module = importlib.import_module(where)
        cls = getattr(module, name, None)
        assert inspect.isclass(cls) and issubclass(cls, BaseException), f"{where}.{name}"
        assert bases == [b.__name__ for b in cls.__bases__], f"{name}'s bases in docs/errors.md"
    for name in _native_errors():
        assert name in rows, f"moecomm._C.{name} is missing from docs/errors.md"


def test_unknown_names_still_raise_attribute_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a name that never existed
        for module in (moecomm, moecomm.errors):
            with pytest.raises(AttributeError, match="no attribute 'NoSuchError'"):
                _ = module.NoSuchError
            assert not hasattr(module, "NoSuchError")
