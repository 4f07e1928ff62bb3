"""Where the engine environment is, whether it is current, and how a process reaches the engines
through it (tools/engines_env.sh builds it). Imported by the conftest (location, freshness) and,
first thing, by every rank process (`activate`).

`activate` does three things, and nothing else changes in the process:

1. appends the engine folder to ``sys.path`` *after* the venv's site-packages, so torch, numpy,
   transformers, ... stay the venv's (the folder holds only what the venv lacks);
2. makes ``import deep_ep`` and ``import nixl_ep`` reach moecomm the way a user's engine
   workers do: the opt-in alias package (engines/alias, installed into the engine folder by
   tools/engines_env.sh) is switched on with ``MOECOMM_AS_DEEP_EP=1`` / ``MOECOMM_AS_NIXL_EP=1``
   and its ``.pth`` line runs when the folder is added as a site directory; the process then
   checks that ``find_spec`` answers both names with moecomm's modules;
3. gives SGLang a stand-in ``torchvision``, visible to SGLang's modules only. SGLang's package
   import reaches ``sglang/srt/multimodal/internvl_utils.py`` (through ``sglang.srt.configs``),
   which imports torchvision at module level; PyPI's torchvision wheels link CUDA torch
   (``libc10_cuda.so``), the CPU wheel lives on PyTorch's own index, which CI cannot reach. The
   stand-in's attributes raise when called: the MoE dispatch code never calls them. Other
   importers (transformers probes torchvision with ``find_spec``) still see none.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).resolve().parent / "requirements.txt"
# The alias package's files: installed with the engines, part of the stamp (an edit reinstalls).
ALIAS_FILES = [ROOT / "engines" / "alias" / n for n in
               ("moecomm_engine_alias.py", "moecomm_engine_alias.pth")]  # fmt: skip
ALIASES = {"deep_ep": "moecomm.compat.deep_ep", "nixl_ep": "moecomm.compat.nixl_ep"}
ALIAS_ENV = {"deep_ep": "MOECOMM_AS_DEEP_EP", "nixl_ep": "MOECOMM_AS_NIXL_EP"}
# Where the rank processes put their tensors: "cpu"; test_engines_gpu.py sets "cuda".
DEVICE = os.environ.get("MOECOMM_ENGINES_DEVICE", "cpu")


def engines_dir() -> Path:
    return Path(os.environ.get("MOECOMM_ENGINES_DIR", ROOT / ".venv" / "engines"))


def site_dir() -> Path:
    return engines_dir() / "site"


def expected_stamp() -> str:
    """What tools/engines_env.sh writes into .stamp: the requirements' hash, the Python."""
    data = REQUIREMENTS.read_bytes() + b"".join(p.read_bytes() for p in ALIAS_FILES)
    digest = hashlib.sha256(data).hexdigest()
    return f"{digest}\npython{sys.version_info[0]}.{sys.version_info[1]}\n"


def why_unavailable() -> str | None:
    """None when the environment is there and current, else why not (and how to make it)."""
    stamp = engines_dir() / ".stamp"
    if not site_dir().is_dir() or not stamp.is_file():
        return f"the engine environment is absent ({engines_dir()}): run tools/engines_env.sh"
    if stamp.read_text() != expected_stamp():
        return (
            f"the engine environment ({engines_dir()}) does not match "
            "tests/engines/requirements.txt: run tools/engines_env.sh"
        )
    return None


class _Unusable:
    """An attribute of the torchvision stand-in: any call raises, naming it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a stand-in (no CPU torchvision in the engine env)")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)


class _TorchvisionForSglang(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``torchvision`` (and submodules) only when the importing module is SGLang's."""

    ROOT_NAME = "torchvision"

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != self.ROOT_NAME:
            return None
        frame = sys._getframe(1)
        while frame is not None and (
            frame.f_code.co_filename.startswith("<frozen")
            or "importlib" in frame.f_code.co_filename
        ):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if not importer.startswith(("sglang", self.ROOT_NAME)):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def getattr_(attr: str, _prefix=spec.name):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Unusable(f"{_prefix}.{attr}")

        module.__getattr__ = getattr_
        return module

    def exec_module(self, module) -> None:
        pass


def nixl_ep_module():
    """moecomm.compat.nixl_ep (kept as a function: the NIXL-EP tests ask for it by name)."""
    return importlib.import_module("moecomm.compat.nixl_ep")


def check_aliases() -> None:
    """The alias answered both names with moecomm's modules (else: a clear error, not a run
    against whatever else ``deep_ep`` might be)."""
    import importlib.util

    for name, target in ALIASES.items():
        spec = importlib.util.find_spec(name)
        module = importlib.import_module(name)
        if spec is None or module.__name__ != target:
            raise RuntimeError(
                f"`import {name}` did not reach {target} (got {module.__name__}): is "
                f"engines/alias installed in {site_dir()} (tools/engines_env.sh)?"
            )


def activate() -> None:
    import site

    for env in ALIAS_ENV.values():
        os.environ[env] = "1"
    folder = str(site_dir())
    if folder not in sys.path:
        site.addsitedir(folder)  # appended after the venv's; runs the alias's .pth line
    if not any(isinstance(f, _TorchvisionForSglang) for f in sys.meta_path):
        sys.meta_path.append(_TorchvisionForSglang())
    check_aliases()
