"""Where the placement controller takes a new copy's weights from: the target's checkpoint first
by default (measured faster than a peer's pull: docs/placement.md), a peer first when asked, and
never the checkpoint of a server that says it has none (GET /experts tells). Real expert servers
on real HTTP for what a server says; the order itself from the controller's own views."""

from __future__ import annotations

import httpx
import pytest
from moecomm.runtime.control import HttpServer, make_app
from moecomm.runtime.launch import ModelSpec
from moecomm.runtime.placement import PlacementController
from moecomm.runtime.placement_views import Move, ServerView
from moecomm.runtime.server import ExpertServer

SPEC = ModelSpec(num_layers=1, num_experts=4, hidden=32, intermediate=16, seed=3)
TOKEN = "t0ken"


def view(url: str, experts: list[int], checkpoint: bool = True) -> ServerView:
    return ServerView(url, url, 1, {0: experts}, {}, {}, checkpoint)


@pytest.fixture
def served():
    """Starts in-process expert servers with or without a checkpoint; stops them all."""
    started = []

    def start(weight_source) -> str:
        experts = {0: {e: w for e, w in SPEC.experts()[0].items() if e < 2}}
        server = ExpertServer(experts, f"s{len(started)}", weight_source=weight_source)
        http = HttpServer(make_app(server, TOKEN))
        server.start()
        started.append((server, http))
        return http.start()

    try:
        yield start
    finally:
        for server, http in started:
            http.stop()
            server.close()


def test_a_server_says_whether_it_has_a_checkpoint(served):
    with_ckpt = served(lambda layer, e: SPEC.experts()[layer][e])
    without = served(None)
    assert httpx.get(f"{with_ckpt}/experts", timeout=10).json()["checkpoint"] is True
    assert httpx.get(f"{without}/experts", timeout=10).json()["checkpoint"] is False
    assert ServerView.from_json(without, httpx.get(f"{without}/experts").json()).checkpoint is False


def test_the_checkpoint_comes_first_by_default_and_a_peer_when_asked():
    views = [view("http://a", [0, 1]), view("http://b", [2, 3])]
    move = Move(0, 2, "http://a", "load")
    default = PlacementController(["http://a", "http://b"], TOKEN, min_tokens=0)
    assert default.weights_from == "checkpoint"
    assert default._sources(move, views) == [("checkpoint", ""), ("peer", "http://b")]
    peer_first = PlacementController(["http://a"], TOKEN, weights_from="peer")
    assert peer_first._sources(move, views) == [("peer", "http://b"), ("checkpoint", "")]


def test_a_server_without_a_checkpoint_is_only_asked_to_pull_from_a_peer():
    views = [view("http://a", [0, 1], checkpoint=False), view("http://b", [2, 3])]
    move = Move(0, 3, "http://a", "load")
    for weights_from in ("checkpoint", "peer"):
        c = PlacementController(["http://a", "http://b"], TOKEN, weights_from=weights_from)
        assert c._sources(move, views) == [("peer", "http://b")]
    # No peer holds it either: its checkpoint is the only source left to try.
    alone = Move(0, 3, "http://a", "load")
    c = PlacementController(["http://a"], TOKEN)
    assert c._sources(alone, [views[0]]) == [("checkpoint", "")]
