"""The placement controller's data: what a server's GET /experts says (ServerView), one replica
to load or drop (Move), what one pass did (RebalanceReport), and the imbalance a placement
gives a load."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class Move:
    layer: int
    expert: int
    server: str  # control URL of the server that loads or drops the replica
    action: str  # "load" | "drop"


@dataclass
class ServerView:
    """What GET /experts said about one server."""

    url: str
    server_id: str
    epoch: int
    layers: dict[int, list[int]]  # local index -> logical expert, -1 where none
    leaving: dict[int, list[int]]
    load: dict[tuple[int, int], int]  # (layer, expert) -> tokens served since start
    # Whether it can read experts from a checkpoint (a server that does not say: assume so).
    checkpoint: bool = True

    def live(self, layer: int) -> set[int]:
        return {e for e in self.layers.get(layer, []) if e >= 0}

    @classmethod
    def from_json(cls, url: str, body: dict) -> ServerView:
        return cls(
            url,
            body["server_id"],
            int(body.get("epoch", 0)),
            {int(k): list(v) for k, v in body["layers"].items()},
            {int(k): list(v) for k, v in body.get("leaving", {}).items()},
            {(int(r["layer"]), int(r["expert"])): int(r["tokens"]) for r in body["load"]},
            bool(body.get("checkpoint", True)),
        )


@dataclass
class RebalanceReport:
    """One pass of the controller. Imbalance is max/mean tokens per server, averaged over
    layers, of the window's loads spread over each placement (replicas share an expert's load
    equally, as the clients' round robin does)."""

    started: float
    trigger: str = "interval"  # "restore": a pass that re-homed the copies a lost server held
    window_tokens: int = 0
    servers: int = 0
    imbalance_before: float = 1.0
    imbalance_after: float = 1.0
    moves: list[Move] = field(default_factory=list)
    replicas_loaded: int = 0
    replicas_dropped: int = 0
    bytes_moved: int = 0
    load_seconds: list[float] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)
    plan_seconds: float = 0.0  # planning the moves (rebalance_incremental), before any load
    apply_seconds: float = 0.0
    # Per load batch (one per target server; one per expert on the per-expert path): seconds
    # spent getting the weights (checkpoint read or peer pull) and rebuilding + publishing.
    fetch_seconds: list[float] = field(default_factory=list)
    build_seconds: list[float] = field(default_factory=list)
    load_batches: int = 0
    converge_seconds: float = 0.0
    skipped: str = ""
    errors: list[str] = field(default_factory=list)
    min_replicas: int = 1  # copies asked for
    min_replicas_held: int = 0  # every expert of the planned layers is on this many servers
    redundancy_note: str = ""  # why min_replicas_held < min_replicas ("" when it holds)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["moves"] = [asdict(m) for m in self.moves]
        return out


def imbalance(placement: dict[int, list[set[int]]], weights: dict[int, np.ndarray]) -> float:
    """Mean over layers of max/mean server load; each expert's load split over its replicas."""
    ratios = []
    for layer, sets in placement.items():
        w = weights[layer]
        count = np.zeros(len(w))
        for s in sets:
            for e in s:
                count[e] += 1
        per_replica = np.divide(w, count, out=np.zeros(len(w)), where=count > 0)
        loads = np.array([sum(per_replica[e] for e in s) for s in sets])
        ratios.append(float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0)
    return float(np.mean(ratios)) if ratios else 1.0
