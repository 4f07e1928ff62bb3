"""The old import paths of the slot wire (moecomm.slots, moecomm.runtime.transports, ...) still
import, warn with the new home, and hand out the very objects of the new modules."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import moecomm
import moecomm.wire.cuda
import pytest
from moecomm import _moved

# The public names each module that moved whole had, by old path: they must resolve there too.
WHOLE = {
    "moecomm.protocol": ["Encoding", "SlotLayout", "ENCODING_DTYPE", "as_encoding", "make_signal"],
    "moecomm.nixl": ["NixlEngine", "NixlTransport", "TensorRegion", "available", "interface_of"],
    "moecomm.cuda": ["GpuUnavailableError", "available", "cuda_module", "arrival_timeout_ns"],
    "moecomm.slot_channel": ["DEFAULT_TIMEOUT_S", "DEFAULT_NUM_SLOTS", "POISON_ENV", "read_reason"],
    "moecomm.slots_server": ["Request", "ServerChannel"],
    "moecomm.slot_views": ["RequestViews", "check_request_shape", "mapped_views", "request_views"],
    "moecomm.stage_channel": ["StageSender", "StageReceiver", "StageInbox", "stage_layout"],
    "moecomm.runtime.transports": ["Doorbells", "ShmProbe", "TransportSet", "boot_id", "choose"],
}


def _fresh_import(old: str):
    """Imports `old` as a first import would (not from sys.modules), returning it and the
    DeprecationWarnings it raised."""
    sys.modules.pop(old, None)
    parent, _, child = old.rpartition(".")
    vars(importlib.import_module(parent)).pop(child, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        __import__(old)  # as an import statement does (importlib.import_module adds a frame)
    module = sys.modules[old]
    return module, [w for w in caught if issubclass(w.category, DeprecationWarning)]


def test_the_table_covers_every_old_module():
    assert set(_moved.MOVED) == set(WHOLE) | {"moecomm.transport", "moecomm.slots"}


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_path_imports_warns_and_names_the_new_home(old):
    module, caught = _fresh_import(old)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert old in message
    homes = _moved.MOVED[old]
    for home in [homes] if isinstance(homes, str) else set(homes.values()):
        assert home in message
    # The warning points at the importer (this file), not at the import machinery.
    assert caught[0].filename == __file__
    assert module is sys.modules[old]


@pytest.mark.parametrize("old", sorted(WHOLE))
def test_a_module_moved_whole_is_the_new_module_itself(old):
    new = importlib.import_module(_moved.MOVED[old])
    module, _ = _fresh_import(old)
    assert module is new
    for name in WHOLE[old]:
        assert getattr(module, name) is getattr(new, name)


@pytest.mark.parametrize("old", ["moecomm.transport", "moecomm.slots"])
def test_every_name_of_a_split_module_is_the_object_of_its_new_home(old):
    module, _ = _fresh_import(old)
    for name, home in _moved.MOVED[old].items():
        assert getattr(module, name) is getattr(importlib.import_module(home), name), name
    assert sorted(module.__all__) == sorted(_moved.MOVED[old])
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        module.nope  # noqa: B018


def test_from_imports_of_old_paths_give_the_new_objects():
    from moecomm.wire.choose import TransportSet, make_transport
    from moecomm.wire.client import ClientChannel
    from moecomm.wire.protocol import SlotLayout
    from moecomm.wire.server import ServerChannel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from moecomm.protocol import SlotLayout as OldLayout
        from moecomm.runtime.transports import TransportSet as OldSet
        from moecomm.slots import ClientChannel as OldClient
        from moecomm.slots import ServerChannel as OldServer
        from moecomm.transport import make_transport as old_make

    assert (OldLayout, OldSet, OldClient, OldServer, old_make) == (
        SlotLayout,
        TransportSet,
        ClientChannel,
        ServerChannel,
        make_transport,
    )


def test_the_package_names_point_at_the_new_homes():
    from moecomm.wire.client import ClientChannel, Response
    from moecomm.wire.protocol import SlotLayout
    from moecomm.wire.server import Request, ServerChannel
    from moecomm.wire.shm import ShmTransport, reap_stale_segments

    for name, obj in {
        "ClientChannel": ClientChannel,
        "Response": Response,
        "ServerChannel": ServerChannel,
        "Request": Request,
        "SlotLayout": SlotLayout,
        "ShmTransport": ShmTransport,
        "reap_stale_segments": reap_stale_segments,
    }.items():
        assert getattr(moecomm, name) is obj
    assert moecomm.wire.cuda is moecomm.__getattr__("wire").cuda


def test_nixl_transport_is_a_deprecated_name_for_open_nixl_transport(monkeypatch):
    import moecomm.wire.nixl as nixl

    seen = {}
    monkeypatch.setattr(
        nixl, "open_nixl_transport", lambda *a, **k: seen.setdefault("args", (a, k))
    )
    with pytest.warns(DeprecationWarning, match="open_nixl_transport"):
        nixl.NixlTransport("10.0.0.1", xfer_timeout_s=3)
    assert seen["args"] == (("10.0.0.1",), {"xfer_timeout_s": 3})


def test_a_real_module_at_an_old_path_would_win_and_new_names_are_not_answered():
    finder = _moved._FINDER
    assert finder in sys.meta_path
    assert finder.find_spec("moecomm.wire.protocol") is None
    assert finder.find_spec("moecomm.runtime.client") is None


def test_importing_moecomm_itself_does_not_touch_an_old_path():
    code = (
        "import sys, warnings; warnings.simplefilter('error', DeprecationWarning);"
        "import moecomm, moecomm.wire.client, moecomm.wire.choose, moecomm.wire.stage;"
        "import moecomm.runtime, moecomm.pipeline;"
        f"old = set({sorted(_moved.MOVED)!r}) & set(sys.modules); print(sorted(old))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
