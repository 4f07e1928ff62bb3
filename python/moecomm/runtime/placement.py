"""Live expert re-placement: read the serving expert servers' loads, compute a low-movement
placement (``moecomm.eplb.rebalance_incremental``) and apply it while they serve.

Safe order: every replica to add is loaded first (weights pulled from a peer that hosts the
expert, or read from the server's own checkpoint), published, and only then are the replicas
that leave marked as leaving. Each server gets its changes as one batch: all the experts it
loads in one request (each layer's weights rebuilt once, the new table published in one epoch),
later all the experts it drops in another (one epoch), the servers in parallel. A leaving
replica is still served; the server frees it once every client has picked up the new table
(docs/placement.md). So at every moment each expert has a
published replica, and no client request is ever lost to a move.

Redundancy: with `min_replicas` k every plan puts each expert on k distinct servers (as many as
host the layer, when fewer), and while the controller runs (start()) a watch re-reads the
servers' tables when something changed: a server lost (the idle TCP connection the watch holds
to its control port closes, or stops answering the kernel's keep-alive probes, and a new one is
refused), a server back or added (the server list changed), or, as a safety net for tables
changed by someone else, every `safety_poll_s`. An expert below its copies is then re-homed at
once, without waiting for the next load-driven pass. An idle watch reads no table between safety
polls: with S servers the old watch's S/`watch_s` reads a second (one read outlasts 0.1 s from
~100 servers, docs/scale.md) become S/`safety_poll_s`. notified=False keeps the old watch (every
table every `watch_s`), for the benchmarks.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
import torch

from moecomm.eplb import combine_windows, rebalance_incremental
from moecomm.eplb.redundancy import check_min_replicas
from moecomm.errors import MoecommError
from moecomm.runtime.control import HTTP_TIMEOUT_S

log = logging.getLogger("moecomm.placement")

WEIGHT_SOURCES = ("peer", "checkpoint")
# Load windows kept for the placement decision, oldest first (combine_windows weighs recent
# windows more): one window of a bursty load should not move experts on its own.
DEFAULT_WINDOWS = 4
# Fewer tokens than this in the combined windows say nothing about the load: no re-placement.
MIN_WINDOW_TOKENS = 256
# How long apply() waits for the servers to free the replicas that left (every client must
# first pick up the new table; an idle client is waited for at most the server's drop grace).
CONVERGE_TIMEOUT_S = 30.0
CONVERGE_POLL_S = 0.05
# Loads may take long on a real checkpoint (a DeepSeek-V3 expert is 44 MB); the HTTP deadline of
# a load is this multiple of the controller's.
LOAD_TIMEOUT_FACTOR = 6
# How often the running controller checks that every expert still has its copies (a GET
# /experts of each server without its load table, a few ms): the detection part of the time
# from a server's loss to restored redundancy. A killed server refuses the next connect at once.
REDUNDANCY_WATCH_S = 0.1
# The notified watch's safety poll: every table is re-read this often even with no event, for
# tables changed by someone other than this controller (a second controller, an operator's
# `moecomm` command). Losses and joins do not wait for it.
SAFETY_POLL_S = 10.0
# ...and at most this many of its table reads a second over all servers (~1.4 ms of controller
# CPU each, bench/scale/scale_placement.py): from 1,000 servers on the safety poll stretches (80 s at
# 8,000) so that it stays near 0.15 of a core, instead of growing with the servers.
SAFETY_READS_PER_S = 100.0
# A server the watch cannot connect to is tried again this often (a refused connect is cheap),
# so one that comes back is re-read within this long.
DOWN_RETRY_S = 1.0
# Kernel keep-alive on the watch's connections: a host that dies without closing its sockets
# (power, network) is noticed after about IDLE + INTERVAL * COUNT seconds of silence.
KEEPALIVE_IDLE_S = 2
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_COUNT = 2
# After a restore pass that could not restore everything (a load failed), the watch waits this
# long before the next try instead of hammering the servers.
RESTORE_RETRY_S = 1.0


class BatchUnsupportedError(MoecommError):
    """The server has no batch route (it is from before them): load or drop one by one."""


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


def _imbalance(placement: dict[int, list[set[int]]], weights: dict[int, np.ndarray]) -> float:
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


class PlacementController:
    """Re-places experts over live expert servers. `servers` is a list of control URLs or a
    callable returning the current ones (a front end passes its client's live servers).

    weights_from: "peer" pulls a replica's weights from a server that hosts it (over the
    transport), falling back to the target's checkpoint; "checkpoint" reads the checkpoint
    first and falls back to a peer.

    min_replicas: copies of every expert on distinct servers (default 1, EPLB's placement;
    `moecomm` commands default to 2). watch_s: how often start()'s watch looks at its events
    (the server list, its connections; no request) (0: no watch); safety_poll_s: how often it
    re-reads every table with no event (longer with over SAFETY_READS_PER_S * safety_poll_s
    servers). notified=False: the old watch, every table every watch_s.

    batched (default): each server loads all its new experts in one request (one rebuild per
    layer, one epoch) and drops its leaving ones in another. batched=False is the per-expert
    path (one request, one rebuild and one epoch per expert), kept for servers from before the
    batch routes and as the benchmarks' baseline; a batch a server does not know (404) falls
    back to it."""

    def __init__(
        self,
        servers: Sequence[str] | Callable[[], Sequence[str]],
        token: str = "",
        *,
        weights_from: str = "peer",
        num_groups: int = 1,
        min_gain: float = 0.05,
        windows: int = DEFAULT_WINDOWS,
        min_tokens: int = MIN_WINDOW_TOKENS,
        timeout: float = HTTP_TIMEOUT_S,
        converge_timeout: float = CONVERGE_TIMEOUT_S,
        on_report: Callable[[RebalanceReport], None] | None = None,
        min_replicas: int = 1,
        watch_s: float = REDUNDANCY_WATCH_S,
        batched: bool = True,
        notified: bool = True,
        safety_poll_s: float = SAFETY_POLL_S,
    ):
        if weights_from not in WEIGHT_SOURCES:
            raise ValueError(f"weights_from must be one of {WEIGHT_SOURCES}, got {weights_from!r}")
        if watch_s < 0:
            raise ValueError(f"watch_s must be >= 0, got {watch_s}")
        if safety_poll_s <= 0:
            raise ValueError(f"safety_poll_s must be > 0, got {safety_poll_s}")
        self.min_replicas = check_min_replicas(min_replicas)
        self.watch_s = watch_s
        self.notified = notified
        self.safety_poll_s = safety_poll_s
        self.batched = batched
        # One HTTP client for every request of the controller (thread-safe, keeps connections
        # open): a fresh client per request costs ~25 ms of CPU (its TLS context), which the
        # watch would pay for every server every tick.
        self._http: httpx.Client | None = None
        self._http_lock = threading.Lock()
        self._servers = servers if callable(servers) else (lambda s=list(servers): s)
        self.token = token
        self.weights_from = weights_from
        self.num_groups = num_groups
        self.min_gain = min_gain
        self.min_tokens = min_tokens
        self.timeout = timeout
        self.converge_timeout = converge_timeout
        self.on_report = on_report
        self._windows: deque[dict[tuple[int, int], int]] = deque(maxlen=windows)
        self._last: dict[str, tuple[str, dict[tuple[int, int], int]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch_thread: threading.Thread | None = None
        # One pass at a time: a restore and a load-driven pass would plan from the same tables.
        self._pass = threading.Lock()
        self._unanswered: set[str] = set()  # servers whose last GET /experts failed
        self._report_lock = threading.Lock()
        self.reports: list[RebalanceReport] = []
        self._num_experts: dict[int, int] = {}  # layer -> experts seen in any pass

    # ------------------------------------------------------------------ reading the servers
    def _client(self) -> httpx.Client:
        with self._http_lock:
            if self._http is None:
                self._http = httpx.Client(timeout=self.timeout)
            return self._http

    def snapshot(self, load: bool = True) -> list[ServerView]:
        """GET /experts of every server, all at once (the watch's detection time is one round
        trip, not one per server); without the load table with load=False. A server that does
        not answer is left out of this pass. Views keep the servers' order."""
        urls = list(self._servers())
        params = None if load else {"load": "false"}

        def read(url: str) -> ServerView | None:
            try:
                r = self._client().get(f"{url}/experts", params=params, timeout=self.timeout)
                r.raise_for_status()
                view = ServerView.from_json(url, r.json())
            except (httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
                # Said once per outage: the watch re-reads a lost server every tick.
                with self._report_lock:
                    if url not in self._unanswered:
                        log.warning("placement: %s left out of this pass: %s", url, exc)
                    self._unanswered.add(url)
                return None
            with self._report_lock:
                self._unanswered.discard(url)
            return view

        if len(urls) <= 1:
            views = [read(u) for u in urls]
        else:
            with ThreadPoolExecutor(len(urls), thread_name_prefix="moecomm-snapshot") as pool:
                views = list(pool.map(read, urls))
        return [v for v in views if v is not None]

    def _window(self, views: list[ServerView]) -> dict[tuple[int, int], int]:
        """Tokens per (layer, expert) served since the previous snapshot, over all servers."""
        total: dict[tuple[int, int], int] = {}
        for v in views:
            prev_id, prev = self._last.get(v.url, ("", {}))
            same = prev_id == v.server_id
            for key, n in v.load.items():
                # A restarted server counts from zero again: take its whole count.
                base = prev.get(key, 0) if same and prev.get(key, 0) <= n else 0
                total[key] = total.get(key, 0) + n - base
            self._last[v.url] = (v.server_id, dict(v.load))
        return total

    def _weights(self, layers: list[int], num_experts: dict[int, int]) -> dict[int, np.ndarray]:
        out = {}
        for layer in layers:
            if not self._windows:  # a restore before any load-driven pass: no load known yet
                out[layer] = np.zeros(num_experts[layer])
                continue
            stack = np.zeros((len(self._windows), num_experts[layer]))
            for i, w in enumerate(self._windows):
                for (lay, e), n in w.items():
                    if lay == layer and e < num_experts[layer]:
                        stack[i, e] = n
            out[layer] = combine_windows(stack[:, None, :])[0].numpy()
        return out

    # ------------------------------------------------------------------ planning
    def _learn_experts(self, views: list[ServerView]) -> dict[int, int]:
        """Experts per layer, remembered across passes: after a server is lost, experts it alone
        held are still part of the layer, and the plan gives them new homes."""
        num_experts = self._num_experts
        for v in views:
            for layer, ids in v.layers.items():
                top = max([*ids, *v.leaving.get(layer, []), -1]) + 1
                num_experts[layer] = max(num_experts.get(layer, 0), top)
        return num_experts

    def _copies(self, placement: dict[int, list[set[int]]]) -> dict[int, np.ndarray]:
        """{layer: [E] servers holding each expert}."""
        out = {}
        for layer, sets in placement.items():
            count = np.zeros(self._num_experts.get(layer, 0), dtype=np.int64)
            for s in sets:
                for e in s:
                    if e < count.size:
                        count[e] += 1
            out[layer] = count
        return out

    def short_layers(self, views: list[ServerView]) -> list[int]:
        """Layers where an expert is on fewer servers than min_replicas (or than the servers
        hosting the layer, when fewer): after a loss, what a restore pass re-homes."""
        today = {
            layer: [v.live(layer) for v in views if v.live(layer)] for layer in self._num_experts
        }
        short = []
        for layer, count in self._copies(today).items():
            need = min(self.min_replicas, len(today[layer])) if today[layer] else 1
            if count.size and int(count.min()) < need:
                short.append(layer)
        return short

    def plan(self, views: list[ServerView], weights: dict[int, np.ndarray]):
        """(moves, placement before, placement after, notes) for the layers in `weights`.
        Layers are placed over the servers that host them today, grouped so one rebalance call
        covers all layers with the same server set; every expert gets min_replicas copies on
        distinct servers, or as many as there are servers (said in `notes`)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for layer in sorted(weights):
            hosts = tuple(i for i, v in enumerate(views) if v.live(layer))
            if hosts:
                groups.setdefault(hosts, []).append(layer)
        moves: list[Move] = []
        notes: list[str] = []
        before: dict[int, list[set[int]]] = {}
        after: dict[int, list[set[int]]] = {}
        for hosts, layers in groups.items():
            num_experts = len(weights[layers[0]])
            same = [la for la in layers if len(weights[la]) == num_experts]
            n = len(hosts)
            copies = min(self.min_replicas, n)
            if copies < self.min_replicas:
                notes.append(
                    f"min_replicas={self.min_replicas} cannot hold for layers {same}: "
                    f"{n} server{'s' if n > 1 else ''} host them; {copies} cop"
                    f"{'y' if copies == 1 else 'ies'} of each expert"
                )
            # Slots per server: what the fullest server holds today, and enough for every
            # expert to have `copies` replicas on distinct servers (servers left after a loss
            # take the orphans and the lost copies).
            slots = max(len(views[h].live(la)) for h in hosts for la in same)
            slots = max(slots, -(-copies * num_experts // n))
            prev = np.zeros((len(same), n * slots), dtype=np.int64)
            for row, layer in enumerate(same):
                for g, h in enumerate(hosts):
                    have = sorted(views[h].live(layer))
                    # Padding repeats the server's own experts: no move comes from it.
                    prev[row, g * slots : (g + 1) * slots] = [
                        have[i % len(have)] for i in range(slots)
                    ]
            weight = np.stack([weights[la] for la in same])
            new = rebalance_incremental(
                torch.from_numpy(prev),
                torch.from_numpy(weight),
                n * slots,
                self.num_groups,
                1,
                n,
                min_gain=self.min_gain,
                min_replicas=copies,
            )[0].numpy()
            for row, layer in enumerate(same):
                before[layer] = [views[h].live(layer) for h in hosts]
                after[layer] = [set(new[row, g * slots : (g + 1) * slots]) for g in range(n)]
                for g, h in enumerate(hosts):
                    old_set, new_set = before[layer][g], after[layer][g]
                    url = views[h].url
                    moves += [Move(layer, int(e), url, "load") for e in sorted(new_set - old_set)]
                    moves += [Move(layer, int(e), url, "drop") for e in sorted(old_set - new_set)]
        return moves, before, after, notes

    # ------------------------------------------------------------------ applying
    def _post(self, url: str, route: str, body: dict, timeout: float) -> dict:
        r = self._client().post(
            f"{url}{route}", json={**body, "token": self.token}, timeout=timeout
        )
        if r.status_code == 404 and route.endswith("_batch"):
            raise BatchUnsupportedError(f"{url}{route}: not found")
        if r.status_code != 200:
            raise RuntimeError(f"{url}{route} refused ({r.status_code}): {r.text[:300]}")
        return r.json()

    def _sources(self, move: Move, views: list[ServerView]) -> list[tuple[str, str]]:
        """Where `move`'s weights may come from, preferred first: (source, peer URL)."""
        peers = [v.url for v in views if v.url != move.server and move.expert in v.live(move.layer)]
        order = [("peer", p) for p in peers[:1]] + [("checkpoint", "")]
        if self.weights_from == "checkpoint":
            order.reverse()
        return order

    def _load_batch(self, moves: list[Move], views: list[ServerView], report) -> list[Move]:
        """All of one server's loads in one request, each from its preferred source; if that
        fails, once more from each one's other source; if that fails too (or the server has no
        batch route), one by one. Returns the moves that loaded."""
        orders = [self._sources(m, views) for m in moves]
        errors = []
        for attempt in range(2):
            body = {
                "experts": [
                    dict(zip(("source", "peer"), o[min(attempt, len(o) - 1)], strict=True))
                    | {"layer": m.layer, "expert": m.expert}
                    for m, o in zip(moves, orders, strict=True)
                ]
            }
            try:
                out = self._post(
                    moves[0].server,
                    "/experts/load_batch",
                    body,
                    self.timeout * LOAD_TIMEOUT_FACTOR,
                )
            except BatchUnsupportedError:
                break
            except (httpx.HTTPError, RuntimeError) as exc:
                errors.append(str(exc))
                continue
            with self._report_lock:  # batches to different servers run in parallel
                report.replicas_loaded += len(moves)
                report.load_batches += 1
                report.bytes_moved += int(out["bytes"])
                report.load_seconds.append(float(out["seconds"]))
                report.fetch_seconds.append(
                    float(out.get("pull_seconds", 0.0)) + float(out.get("read_seconds", 0.0))
                )
                report.build_seconds.append(float(out.get("build_seconds", 0.0)))
                for source, n in out.get("sources", {}).items():
                    report.sources[source] = report.sources.get(source, 0) + int(n)
            return moves
        if errors:
            log.warning("placement: batch load on %s failed: %s", moves[0].server, errors)
        return [m for m in moves if self._load(m, views, report)]

    def _load(self, move: Move, views: list[ServerView], report: RebalanceReport) -> bool:
        order = self._sources(move, views)
        errors = []
        for source, peer in order:
            body = {"layer": move.layer, "expert": move.expert, "source": source, "peer": peer}
            try:
                out = self._post(
                    move.server, "/experts/load", body, self.timeout * LOAD_TIMEOUT_FACTOR
                )
            except (httpx.HTTPError, RuntimeError) as exc:
                errors.append(f"{source}: {exc}")
                continue
            with self._report_lock:  # loads to different servers run in parallel
                report.replicas_loaded += 1
                report.load_batches += 1
                report.bytes_moved += int(out["bytes"])
                report.load_seconds.append(float(out["seconds"]))
                report.sources[source] = report.sources.get(source, 0) + 1
            return True
        with self._report_lock:
            report.errors.append(
                f"load of layer {move.layer} expert {move.expert} on {move.server} failed: "
                + "; ".join(errors)
            )
        return False

    def _load_all(
        self, loads: list[Move], views: list[ServerView], report: RebalanceReport
    ) -> list[Move]:
        """The loads, one thread per target server (a server applies its own changes one at a
        time; different servers copy at once, which is what shortens a restore): one batch per
        server, or one request per expert when not batched. Returns the moves that loaded."""
        by_server: dict[str, list[Move]] = {}
        for m in loads:
            by_server.setdefault(m.server, []).append(m)

        def one_server(ms: list[Move]) -> list[Move]:
            if self.batched:
                return self._load_batch(ms, views, report)
            return [m for m in ms if self._load(m, views, report)]

        if len(by_server) <= 1:
            return [m for ms in by_server.values() for m in one_server(ms)]
        with ThreadPoolExecutor(len(by_server), thread_name_prefix="moecomm-load") as pool:
            return [m for ms in pool.map(one_server, by_server.values()) for m in ms]

    def _drop(self, m: Move, report: RebalanceReport) -> bool:
        try:
            self._post(
                m.server, "/experts/unload", {"layer": m.layer, "expert": m.expert}, self.timeout
            )
        except (httpx.HTTPError, RuntimeError) as exc:
            with self._report_lock:
                report.errors.append(f"drop on {m.server} failed: {exc}")
            return False
        return True

    def _drop_all(self, drops: list[Move], report: RebalanceReport) -> int:
        """The drops, one request (one epoch) per server when batched, the servers in
        parallel; returns how many were marked leaving."""
        by_server: dict[str, list[Move]] = {}
        for m in drops:
            by_server.setdefault(m.server, []).append(m)

        def one_server(ms: list[Move]) -> int:
            if self.batched:
                body = {"experts": [{"layer": m.layer, "expert": m.expert} for m in ms]}
                try:
                    self._post(ms[0].server, "/experts/unload_batch", body, self.timeout)
                    return len(ms)
                except BatchUnsupportedError:
                    pass
                except (httpx.HTTPError, RuntimeError) as exc:
                    with self._report_lock:
                        report.errors.append(f"drops on {ms[0].server} failed: {exc}")
                    return 0
            return sum(self._drop(m, report) for m in ms)

        if len(by_server) <= 1:
            return sum(one_server(ms) for ms in by_server.values())
        with ThreadPoolExecutor(len(by_server), thread_name_prefix="moecomm-drop") as pool:
            return sum(pool.map(one_server, by_server.values()))

    def apply(self, moves: list[Move], views: list[ServerView], report: RebalanceReport) -> None:
        """Loads first, then drops; a drop happens only while another live replica remains."""
        start = time.monotonic()
        loaded = self._load_all([m for m in moves if m.action == "load"], views, report)
        drops = [m for m in moves if m.action == "drop"]
        if drops:
            fresh = self.snapshot()  # what is live now that the loads are done
            holders = {}
            for v in fresh:
                for layer in {m.layer for m in drops}:
                    for e in v.live(layer):
                        holders.setdefault((layer, e), set()).add(v.url)
            safe = []
            for m in drops:
                left = holders.get((m.layer, m.expert), set()) - {m.server}
                if not left:
                    report.errors.append(
                        f"drop of layer {m.layer} expert {m.expert} on {m.server} skipped: "
                        "it would leave the expert without a replica"
                    )
                    continue
                holders[(m.layer, m.expert)].discard(m.server)
                safe.append(m)
            report.replicas_dropped += self._drop_all(safe, report)
        report.apply_seconds = time.monotonic() - start
        if loaded or report.replicas_dropped:
            report.converge_seconds = report.apply_seconds + self._wait_dropped()

    def _wait_dropped(self) -> float:
        """Waits until no server still holds a leaving replica; returns how long it took."""
        start = time.monotonic()
        while time.monotonic() - start < self.converge_timeout:
            if not any(any(v.leaving.values()) for v in self.snapshot()):
                break
            time.sleep(CONVERGE_POLL_S)
        return time.monotonic() - start

    # ------------------------------------------------------------------ one pass, or a loop
    def rebalance(self) -> RebalanceReport:
        """Reads loads, plans and applies one re-placement; returns what it did. With too little
        load to go by it still restores the copies of experts below min_replicas."""
        with self._pass:
            report = RebalanceReport(started=time.time(), min_replicas=self.min_replicas)
            views = self.snapshot()
            report.servers = len(views)
            if not views:
                report.skipped = "no expert server answered"
                return self._done(report)
            self._windows.append(self._window(views))
            num_experts = self._learn_experts(views)
            report.window_tokens = sum(sum(w.values()) for w in self._windows)
            layers = sorted(num_experts)
            if report.window_tokens < self.min_tokens:
                layers = self.short_layers(views)
                if not layers:
                    report.skipped = f"{report.window_tokens} tokens in the load window"
                    return self._done(report)
                report.trigger = "restore"
            return self._plan_and_apply(views, self._weights(layers, num_experts), report)

    def restore(self) -> RebalanceReport | None:
        """One restore pass: when an expert is on fewer servers than min_replicas (a server was
        lost), re-homes the missing copies now (a peer's or the checkpoint's weights), planned
        from the last load windows. None when every expert has its copies."""
        with self._pass:
            views = self.snapshot(load=False)
            if not views:
                return None
            num_experts = self._learn_experts(views)
            layers = self.short_layers(views)
            if not layers:
                return None
            report = RebalanceReport(
                started=time.time(),
                trigger="restore",
                servers=len(views),
                min_replicas=self.min_replicas,
            )
            report.window_tokens = sum(sum(w.values()) for w in self._windows)
            return self._plan_and_apply(views, self._weights(layers, num_experts), report)

    def _plan_and_apply(
        self, views: list[ServerView], weights: dict[int, np.ndarray], report: RebalanceReport
    ) -> RebalanceReport:
        planned = time.monotonic()
        moves, before, after, notes = self.plan(views, weights)
        report.plan_seconds = time.monotonic() - planned
        report.imbalance_before = _imbalance(before, weights)
        report.imbalance_after = _imbalance(after, weights)
        copies = self._copies(after).values()
        report.min_replicas_held = min((int(c.min()) for c in copies if c.size), default=0)
        report.redundancy_note = "; ".join(notes)
        if notes:
            log.warning("placement: %s", report.redundancy_note)
        report.moves = moves
        if not moves:
            report.skipped = "the placement is already balanced"
            return self._done(report)
        self.apply(moves, views, report)
        return self._done(report)

    def _done(self, report: RebalanceReport) -> RebalanceReport:
        self.reports.append(report)
        if self.on_report is not None:
            self.on_report(report)
        if report.moves or report.errors:
            log.info(
                "placement (%s): %d moves (%d loaded, %d dropped, %.1f MB) imbalance %.3f -> "
                "%.3f, %.2f s%s",
                report.trigger,
                len(report.moves),
                report.replicas_loaded,
                report.replicas_dropped,
                report.bytes_moved / 1e6,
                report.imbalance_before,
                report.imbalance_after,
                report.converge_seconds,
                f"; errors: {report.errors}" if report.errors else "",
            )
        return report

    def start(self, interval_s: float) -> None:
        """Re-places every `interval_s` seconds in a background thread until stop(); with
        watch_s > 0 a second thread restores lost copies as soon as they are found missing."""
        if interval_s <= 0:
            raise ValueError(f"the re-placement interval must be > 0, got {interval_s}")
        if self._thread is not None:
            raise RuntimeError("the placement controller is already running")
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.rebalance()
                except Exception:  # a failed pass is logged; the next one tries again
                    log.exception("placement: re-placement pass failed")

        self._thread = threading.Thread(target=loop, name="moecomm-placement", daemon=True)
        self._thread.start()
        if self.watch_s > 0:
            self._watch_thread = threading.Thread(
                target=self._watch, name="moecomm-placement-watch", daemon=True
            )
            self._watch_thread.start()

    def _watch(self) -> None:
        if self.notified:
            self._watch_notified()
            return
        while not self._stop.wait(self.watch_s):
            try:
                report = self.restore()
            except Exception:  # a failed restore is logged; the next tick tries again
                log.exception("placement: restore pass failed")
                report = None
            if report is not None and report.errors:
                self._stop.wait(RESTORE_RETRY_S)

    def _watch_notified(self) -> None:
        """Restore passes on events only: the server list changed, a server's connection closed
        and it refuses a new one (lost), a lost one accepts again, or safety_poll_s passed."""
        conns = _ServerConnections(self.timeout)
        known: list[str] | None = None
        next_read = 0.0  # the first pass reads at once
        try:
            while not self._stop.is_set():
                try:
                    urls = list(self._servers())
                except Exception:  # the caller's list failed: keep the last one
                    log.exception("placement: the server list could not be read")
                    urls = known or []
                if urls != known:
                    known = urls
                    conns.track(urls)
                    next_read = 0.0
                if time.monotonic() >= next_read:
                    period = max(self.safety_poll_s, len(urls) / SAFETY_READS_PER_S)
                    next_read = time.monotonic() + period
                    try:
                        report = self.restore()
                    except Exception:  # a failed restore is logged; the next event tries again
                        log.exception("placement: restore pass failed")
                        report = None
                    if report is not None and report.errors:
                        next_read = time.monotonic() + RESTORE_RETRY_S
                if conns.wait(self.watch_s):
                    next_read = 0.0
        finally:
            conns.close()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        for thread in (self._thread, self._watch_thread):
            if thread is not None:
                thread.join(timeout)
        self._thread = self._watch_thread = None
        with self._http_lock:
            http, self._http = self._http, None
        if http is not None:  # a later pass opens a new one
            http.close()


class _ServerConnections:
    """One idle TCP connection to each server's control port, held by the notified watch. No
    request is ever sent on it: the kernel says when it closes (the server process died, or its
    HTTP server dropped the idle connection) or stops answering keep-alive probes (its host is
    gone). A closed one is reconnected at once; a refused reconnect means the server is lost."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._sel = selectors.DefaultSelector()
        self._socks: dict[str, socket.socket] = {}
        self._down: dict[str, float] = {}  # url -> when to try connecting again

    def track(self, urls: list[str]) -> None:
        for url in set(self._socks) - set(urls):
            self._drop(url)
        for url in set(self._down) - set(urls):
            del self._down[url]
        for url in urls:
            if url not in self._socks and url not in self._down:
                self._connect(url)

    def _connect(self, url: str) -> bool:
        try:
            u = httpx.URL(url)
            sock = socket.create_connection((u.host, u.port or 80), timeout=self.timeout)
        except (OSError, httpx.InvalidURL):
            self._down[url] = time.monotonic() + DOWN_RETRY_S
            return False
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ):
            if hasattr(socket, opt):  # Linux; elsewhere the system's keep-alive defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
        sock.setblocking(False)
        self._socks[url] = sock
        self._down.pop(url, None)
        self._sel.register(sock, selectors.EVENT_READ, url)
        return True

    def _drop(self, url: str) -> None:
        sock = self._socks.pop(url)
        self._sel.unregister(sock)
        sock.close()

    def wait(self, timeout: float) -> bool:
        """Waits up to `timeout` for an event; True when a server was lost or came back."""
        changed = False
        if self._socks:
            events = self._sel.select(timeout)
        else:
            time.sleep(timeout)
            events = []
        for key, _ in events:
            url = key.data
            try:
                if key.fileobj.recv(1):  # a server never writes here unasked: ignore it
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass  # reset, or keep-alive timed out: closed like an EOF
            self._drop(url)
            if not self._connect(url):
                changed = True
        now = time.monotonic()
        for url, at in list(self._down.items()):
            if now >= at and self._connect(url):
                changed = True
        return changed

    def close(self) -> None:
        for url in list(self._socks):
            self._drop(url)
        self._sel.close()
