"""Opt-in import names for engines: ``import deep_ep`` / ``import nixl_ep`` answered by moecomm.

Engines pick an expert-parallel backend by importing it: vLLM checks
``importlib.util.find_spec("deep_ep")`` (and ``"nixl_ep"``) and then imports it; SGLang does
``from deep_ep import Buffer, Config``. This module lets those imports reach
``moecomm.compat.deep_ep`` / ``moecomm.compat.nixl_ep`` in every process of the engine, and only
when asked:

=====================  =============================================================
``MOECOMM_AS_DEEP_EP``  ``1`` (or ``true``/``yes``/``on``): ``import deep_ep`` gives
                        ``moecomm.compat.deep_ep``, unless a real ``deep_ep`` is
                        installed: then the import fails with an error naming it.
                        ``force``: moecomm answers even over a real ``deep_ep``.
                        Unset, empty or ``0``/``false``/``no``/``off``: nothing happens.
``MOECOMM_AS_NIXL_EP``  The same for ``import nixl_ep`` -> ``moecomm.compat.nixl_ep``.
=====================  =============================================================

Installed with ``pip install ./engines/alias`` (a ``moecomm_engine_alias.pth`` in site-packages
runs :func:`startup` at interpreter start in every process, which reads the variables and, only
if one is set, puts an :class:`AliasFinder` first on ``sys.meta_path``), or programmatically with
:func:`install`. The first import of an alias logs one line (logger ``moecomm.engine_alias``,
INFO) and prints one line on stderr::

    moecomm: `import deep_ep` answered by moecomm.compat.deep_ep (MOECOMM_AS_DEEP_EP=1, pid 4242)

The import gives the moecomm module itself (``deep_ep is moecomm.compat.deep_ep``; its
``__name__`` and ``__spec__`` stay moecomm's, so ``find_spec``, ``reload`` and pickling keep
working). ``deep_ep``'s submodules (``deep_ep.utils``, ...) are not provided: the pinned engines
import only top-level names.
"""

from __future__ import annotations

# Only what an interpreter has loaded at start-up anyway: the .pth runs this in every process.
# logging, threading and importlib.util are imported when an alias is first looked up.
import importlib.machinery
import os
import sys

__all__ = [
    "ALIASES",
    "VARIABLES",
    "AliasFinder",
    "install",
    "installed",
    "modes_from_env",
    "startup",
    "uninstall",
]

# Engine import name -> the moecomm module that answers it.
ALIASES = {"deep_ep": "moecomm.compat.deep_ep", "nixl_ep": "moecomm.compat.nixl_ep"}
# Engine import name -> the opt-in variable.
VARIABLES = {"deep_ep": "MOECOMM_AS_DEEP_EP", "nixl_ep": "MOECOMM_AS_NIXL_EP"}
_ON = {"1", "true", "yes", "on"}
_OFF = {"", "0", "false", "no", "off"}
FORCE = "force"

LOGGER = "moecomm.engine_alias"


def modes_from_env(environ=None) -> dict[str, str]:
    """``{name: value}`` for every alias whose variable is set to something other than off:
    ``"on"``, ``"force"``, or the unrecognised value itself (refused at import)."""
    environ = os.environ if environ is None else environ
    modes = {}
    for name, var in VARIABLES.items():
        value = environ.get(var)
        if value is None:
            continue
        v = value.strip().lower()
        if v in _OFF:
            continue
        modes[name] = "on" if v in _ON else FORCE if v == FORCE else value
    return modes


class _AliasLoader:
    """Answers the import with the moecomm module itself (created by importing it)."""

    def __init__(self, name: str, target: str, reason: str) -> None:
        self.name, self.target, self.reason = name, target, reason

    def create_module(self, spec):
        import importlib

        try:
            module = importlib.import_module(self.target)
        except ImportError as exc:
            raise ImportError(
                f"{VARIABLES[self.name]} is set, so moecomm answers `import {self.name}` with "
                f"{self.target}, which failed to import: {exc}",
                name=self.name,
            ) from exc
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system set __spec__ to the alias spec; the module stays moecomm's.
        module.__spec__ = self._own_spec
        _announce(self.name, self.target, self.reason)


_announced: set[str] = set()


def _announce(name: str, target: str, reason: str) -> None:
    if name in _announced:
        return
    _announced.add(name)
    import logging

    line = f"`import {name}` answered by {target} ({reason}, pid {os.getpid()})"
    logging.getLogger(LOGGER).info("%s", line)
    _say(line)


def _say(line: str) -> None:
    """One line on stderr; a closed stderr must not fail an import or start-up."""
    try:  # noqa: SIM105 (contextlib is not loaded at start-up)
        print(f"moecomm: {line}", file=sys.stderr, flush=True)
    except Exception:
        pass


class AliasFinder:
    """Resolves the opted-in engine names (``modes``: name -> "on" / "force" / a bad value) to
    their moecomm modules. Before answering it asks every other finder on ``sys.meta_path``
    whether a real package of that name exists; if one does, ``find_spec`` raises ImportError
    naming it, unless the mode is ``force``."""

    def __init__(self, modes: dict[str, str], targets: dict[str, str] | None = None) -> None:
        self.modes = dict(modes)
        self.targets = dict(ALIASES if targets is None else targets)
        self._busy = None  # a threading.local, made at the first look-up

    def _real_spec(self, name: str):
        """The spec another finder gives `name` (a real package), or None."""
        if self._busy is None:
            import threading

            self._busy = threading.local()
        busy = getattr(self._busy, "names", None)
        if busy is None:
            busy = self._busy.names = set()
        if name in busy:  # another finder asked importlib about this name again
            return None
        busy.add(name)
        try:
            for finder in list(sys.meta_path):
                if isinstance(finder, AliasFinder) or not hasattr(finder, "find_spec"):
                    continue
                try:
                    spec = finder.find_spec(name, None, None)
                except Exception:  # a broken finder is not evidence of a real package
                    continue
                if spec is not None:
                    return spec
            return None
        finally:
            busy.discard(name)

    def find_spec(self, fullname, path=None, target=None):
        mode = self.modes.get(fullname)
        if mode is None or path is not None:
            return None
        var = VARIABLES.get(fullname, "the alias variable")
        if mode not in ("on", FORCE):
            raise ImportError(
                f"{var}={mode!r}: expected 1 (moecomm answers `import {fullname}` unless a real "
                f"{fullname} is installed), force (even then) or 0 (off)",
                name=fullname,
            )
        real = self._real_spec(fullname)
        if real is not None and mode != FORCE:
            raise ImportError(
                f"{var}=1 asks moecomm to answer `import {fullname}`, but a real {fullname} is "
                f"installed ({_where(real)}). Unset {var} to use it, or set {var}=force to "
                f"shadow it with {self.targets[fullname]}",
                name=fullname,
            )
        target_spec = self._target_spec(fullname)
        reason = f"{var}={'force' if mode == FORCE else '1'}"
        if real is not None:
            reason += f", shadowing the real {fullname} at {_where(real)}"
        loader = _AliasLoader(fullname, self.targets[fullname], reason)
        return importlib.machinery.ModuleSpec(fullname, loader, origin=target_spec.origin)

    def _target_spec(self, name: str):
        import importlib.util

        target = self.targets[name]
        try:
            spec = importlib.util.find_spec(target)
        except ImportError as exc:
            spec, why = None, f"{type(exc).__name__}: {exc}"
        else:
            why = "no such module"
        if spec is None:
            raise ModuleNotFoundError(
                f"{VARIABLES.get(name, 'the alias variable')} is set, so moecomm answers "
                f"`import {name}` with {target}, but this moecomm has no {target} ({why}). "
                f"Unset the variable, or install a moecomm that provides it",
                name=name,
            )
        return spec

    def invalidate_caches(self) -> None:
        pass


def _where(spec) -> str:
    if spec.submodule_search_locations:
        return ", ".join(spec.submodule_search_locations)
    return spec.origin or repr(spec)


def installed() -> AliasFinder | None:
    """The finder on ``sys.meta_path``, if any."""
    return next((f for f in sys.meta_path if isinstance(f, AliasFinder)), None)


def install(modes: dict[str, str] | None = None, *, targets: dict[str, str] | None = None):
    """Puts an :class:`AliasFinder` first on ``sys.meta_path`` (replacing one already there) for
    ``modes`` (name -> ``"on"`` or ``"force"``; default: :func:`modes_from_env`). Returns it,
    or None when no alias is asked for. An alias name already imported in this process is left
    as it is (the import system answers from ``sys.modules``)."""
    modes = modes_from_env() if modes is None else dict(modes)
    unknown = set(modes) - set(ALIASES if targets is None else targets)
    if unknown:
        raise ValueError(f"no moecomm alias for {sorted(unknown)}; known: {sorted(ALIASES)}")
    uninstall()
    if not modes:
        return None
    finder = AliasFinder(modes, targets)
    sys.meta_path.insert(0, finder)
    return finder


def uninstall() -> None:
    """Removes every AliasFinder from ``sys.meta_path`` (modules already imported stay)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AliasFinder)]


_startup_failed = False


def startup() -> None:
    """Run by ``moecomm_engine_alias.pth`` at interpreter start: installs the finder when an
    alias variable is set. Never raises: a failure is reported once on stderr."""
    global _startup_failed
    try:
        if modes_from_env():
            install()
    except Exception as exc:
        if not _startup_failed:
            _startup_failed = True
            _say(
                "the engine aliases (MOECOMM_AS_DEEP_EP / MOECOMM_AS_NIXL_EP) were not "
                f"installed: {type(exc).__name__}: {exc}"
            )
