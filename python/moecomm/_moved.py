"""Old import paths of modules that moved, kept working with a DeprecationWarning.

`MOVED` maps each old dotted module name to its new home: a module name when the whole module
moved (the old name then *is* the new module, so patching it patches the real one), or a
``{public name: new module}`` table when the module was split (the old name is then a thin
module whose attributes are looked up in their new homes, the very same objects). A meta-path
finder answers the old names; it is installed by ``moecomm/__init__.py`` and imports nothing
until an old name is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

_PROTOCOL = "moecomm.wire.protocol"
_TRANSPORT = "moecomm.wire.transport"
_SHM = "moecomm.wire.shm"
_VIEWS = "moecomm.wire.views"
_CHOOSE = "moecomm.wire.choose"
_CHANNEL = "moecomm.wire.channel"
_CLIENT = "moecomm.wire.client"
_SERVER = "moecomm.wire.server"

# Old dotted name -> new module, or {public name the old module had: new module}.
MOVED: dict[str, str | dict[str, str]] = {
    "moecomm.protocol": _PROTOCOL,
    "moecomm.nixl": "moecomm.wire.nixl",
    "moecomm.cuda": "moecomm.wire.cuda",
    "moecomm.slot_channel": _CHANNEL,
    "moecomm.slots_server": _SERVER,
    "moecomm.slot_views": _VIEWS,
    "moecomm.stage_channel": "moecomm.wire.stage",
    "moecomm.runtime.transports": _CHOOSE,
    "moecomm.transport": {
        "Region": _TRANSPORT,
        "Transport": _TRANSPORT,
        "SignalOp": _TRANSPORT,
        "WaitOp": _TRANSPORT,
        "WaitStatus": _TRANSPORT,
        "ShmTransport": _SHM,
        "reap_stale_segments": _SHM,
        "list_segments": _SHM,
        "SHM_SPIN_ENV": _SHM,
        "shm_spin_ns": _SHM,
        "region_bytes_view": _VIEWS,
        "view": _VIEWS,
        "RegionViews": _VIEWS,
        "TRANSPORT_CHOICES": _CHOOSE,
        "make_transport": _CHOOSE,
    },
    # slots.py held the client's end and re-exported the server's end and the shared names.
    "moecomm.slots": {
        "ClientChannel": _CLIENT,
        "Response": _CLIENT,
        "ServerChannel": _SERVER,
        "Request": _SERVER,
        "DEFAULT_NUM_SLOTS": _CHANNEL,
        "DEFAULT_TIMEOUT_S": _CHANNEL,
        "POISON_ENV": _CHANNEL,
        "POISON_SLOTS": _CHANNEL,
        "raise_wait_failure": _CHANNEL,
        "read_reason": _CHANNEL,
        "RequestViews": _VIEWS,
        "check_request_shape": _VIEWS,
        "mapped_views": _VIEWS,
        "request_views": _VIEWS,
    },
}


def new_home(old: str) -> str:
    """Where old module `old` went, in words (for the warning)."""
    home = MOVED[old]
    if isinstance(home, str):
        return home
    return ", ".join(sorted(set(home.values())))


def _split_module(old: str, names: dict[str, str]) -> types.ModuleType:
    """A module named `old` whose public names resolve, on use, from their new homes."""
    module = types.ModuleType(old, f"Moved: {old} is now split over {new_home(old)}.")

    def __getattr__(name: str):
        home = names.get(name)
        if home is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    module.__getattr__ = __getattr__
    module.__dir__ = lambda: sorted(names)
    module.__all__ = sorted(names)
    return module


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers the old names of MOVED, and only those."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        home = MOVED[spec.name]
        return None if isinstance(home, str) else _split_module(spec.name, home)

    def exec_module(self, module):
        name = module.__name__
        # stacklevel 2 names the importer: warnings skips the import machinery's own frames.
        warnings.warn(
            f"{name} moved to {new_home(name)}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        home = MOVED[name]
        if isinstance(home, str):
            # The import system hands out whatever sys.modules holds once exec_module returns:
            # the real module, under its old name too.
            sys.modules[name] = importlib.import_module(home)


_FINDER = _MovedFinder()


def install() -> None:
    """Puts the finder last on sys.meta_path (once): a real module of an old name still wins."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
