"""The device client's expert maps stay at one address through membership changes.

A CUDA graph captured over DeviceClient.launch/wait keeps the raw pointers of the expert map it
saw at capture; the maps must therefore be allocated once per layer and rewritten in place on
add/evict/re-add (docs/device-dispatch.md). Checked on CPU: ExpertMaps takes a device, and the
DeviceClient's own code is driven with a stand-in for the native module.
"""

import types

import pytest
import torch
from moecomm.errors import MoecommError
from moecomm.runtime import device_client
from moecomm.runtime.device_client import DeviceClient, _Server
from moecomm.runtime.device_maps import ExpertCapacityError, ExpertMaps

CAP = 16


def ptrs(maps: ExpertMaps, layer: int) -> tuple[int, int]:
    server, local = maps.tensors(layer)
    return server.data_ptr(), local.data_ptr()


def expected(servers: dict, layer: int, cap: int = CAP) -> tuple[list[int], list[int]]:
    """The reference: each expert to the lowest live peer index hosting it."""
    server, local = [-1] * cap, [-1] * cap
    for index in sorted(servers):
        for i, e in enumerate(servers[index].get(layer, [])):
            if e >= 0 and server[e] < 0:
                server[e], local[e] = index, i
    return server, local


def test_maps_keep_their_address_and_follow_membership():
    maps = ExpertMaps("cpu", CAP)
    a = {0: [0, 1, 2, 3], 1: [4, 5]}
    b = {0: [2, 3, 4, 5], 1: [6, -1, 7]}  # replicas of 2..5; a retired local slot
    c = {0: [0, 1, 6, 7]}
    live = {0: a, 1: b}
    maps.update(live)
    first = {layer: ptrs(maps, layer) for layer in (0, 1)}
    states = [
        {0: a, 1: b},
        {1: b},  # evict 0: its experts fall to their replicas or to -1
        {1: b, 2: c},  # a new server at another index
        {},  # everything evicted: the layers stay, all -1
        {0: a, 2: c},  # re-add at index 0
    ]
    for live in states:
        maps.update(live)
        for layer in (0, 1):
            assert ptrs(maps, layer) == first[layer], (
                "a map moved: a captured graph reads freed memory"
            )
            server, local = maps.tensors(layer)
            assert (server.tolist(), local.tolist()) == expected(live, layer)
            assert maps.routable(layer) == {
                e for e, s in enumerate(expected(live, layer)[0]) if s >= 0
            }
    assert maps.layers == [0, 1]


def test_an_expert_beyond_the_capacity_is_refused_and_nothing_changes():
    maps = ExpertMaps("cpu", CAP)
    maps.update({0: {0: [0, 1]}})
    before = maps.tensors(0)[0].tolist()
    with pytest.raises(ExpertCapacityError, match=r"max_experts=16.*max_experts > 16"):
        maps.update({0: {0: [0, 1]}, 1: {0: [CAP]}})
    with pytest.raises(ExpertCapacityError, match="http://x hosts expert 99 of layer 3"):
        maps.check({3: [99]}, "http://x")
    assert maps.tensors(0)[0].tolist() == before
    with pytest.raises(ValueError):
        ExpertMaps("cpu", 0)


class _FakeArgs:
    """DispatchArgs / CombineArgs stand-in: records whatever the client sets."""


def stand_in_client(monkeypatch) -> tuple[DeviceClient, list]:
    """A DeviceClient whose native module, peer table and HTTP calls are stand-ins, on CPU
    tensors: its own map bookkeeping, launch and wait code run unchanged."""
    launches: list = []
    k = types.SimpleNamespace(
        DispatchArgs=_FakeArgs,
        CombineArgs=_FakeArgs,
        client_dispatch=lambda peers, cfg, a, stream: launches.append(("dispatch", a)),
        client_combine=lambda peers, cfg, a, stream: launches.append(("combine", a)),
        SERVER_STATUS={"OK": 0, "TIMEOUT": 1, "PEER_LOST": 2, "NOT_SENT": 3, "SLOT_BUSY": 9},
    )
    table = types.SimpleNamespace(
        kernel_peers=lambda: types.SimpleNamespace(),
        mark_dead=lambda i: None,
        remove_peer=lambda i, streams: None,
    )
    monkeypatch.setattr(device_client, "_stream", lambda device: 0)
    monkeypatch.setattr("moecomm.runtime.control.http_disconnect", lambda *a, **k: None)
    c = DeviceClient.__new__(DeviceClient)
    c._k, c.table, c.device = k, table, torch.device("cpu")
    c.layout = types.SimpleNamespace(hidden=8, max_tokens=4, out_encoding=None)
    c.config, c.timeout, c.token, c.client_id = types.SimpleNamespace(num_servers=4), 0.5, "", 7
    c.workspaces = [torch.zeros(64, dtype=torch.uint8)]
    c.next_seq = torch.zeros(4, dtype=torch.int64)
    c.servers, c._rings, c._trace = {}, {}, None
    c._maps = ExpertMaps("cpu", CAP)
    return c, launches


def test_a_launch_after_failover_reads_the_same_map_at_the_same_address(monkeypatch):
    c, launches = stand_in_client(monkeypatch)
    c.servers = {
        0: _Server("u0", "s0", "", {0: [0, 1, 2, 3]}),
        1: _Server("u1", "s1", "", {0: [2, 3, 4]}),
    }
    c._rebuild_maps()
    x = torch.zeros(2, 8)
    ids = torch.tensor([[0, 2], [3, 4]], dtype=torch.int32)
    w = torch.ones(2, 2)
    c.launch(x, ids, w, layer_id=0, slot=0)
    c.evict(0, "test")
    c.launch(x, ids, w, layer_id=0, slot=0)
    c.servers[2] = _Server("u2", "s2", "", {0: [0, 1]})
    c._rebuild_maps()
    c.launch(x, ids, w, layer_id=0, slot=0)
    args = [a for kind, a in launches if kind == "dispatch"]
    assert len({(a.expert_server, a.expert_local, a.num_experts) for a in args}) == 1
    assert args[0].num_experts == CAP
    server, _ = c.expert_map(0)
    assert server.data_ptr() == args[0].expert_server
    assert server.tolist()[:5] == [2, 2, 1, 1, 1]
    assert c.routable(0) == {0, 1, 2, 3, 4}
    # Every server of the layer gone: its tensors stay (a captured graph still points there),
    # but a new launch is refused, as before any server hosted it.
    for index in list(c.servers):
        c.evict(index, "test")
    assert c.expert_map(0)[0].data_ptr() == args[0].expert_server
    with pytest.raises(MoecommError, match="no connected server hosts layer 0"):
        c.launch(x, ids, w, layer_id=0, slot=0)
