"""Live expert re-placement: read the serving expert servers' loads, compute a low-movement
placement (``moecomm.eplb.rebalance_incremental``) and apply it while they serve.

Safe order: every replica to add is loaded and published before the replicas that leave are
marked as leaving, and a leaving replica is still served until every client has picked up the
new table (docs/placement.md). So at every moment each expert has a published replica, and no
client request is ever lost to a move. With `min_replicas` k every plan puts each expert on k
distinct servers (as many as host the layer, when fewer), and while the controller runs a watch
re-homes the copies a lost server held at once, without waiting for the next load-driven pass.

This module is the controller (reading the servers, planning, one pass or a loop); beside it,
by role: ``placement_views`` (its data: ServerView, Move, RebalanceReport),
``placement_apply`` (the loads and drops over the servers' control routes, batched per
server) and ``placement_watch`` (the notified redundancy watch). Callers import everything from
here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import torch

from moecomm.eplb import combine_windows, rebalance_incremental
from moecomm.eplb.redundancy import check_min_replicas
from moecomm.runtime.control import HTTP_TIMEOUT_S
from moecomm.runtime.placement_apply import (  # noqa: F401  (callers import them from here)
    CONVERGE_TIMEOUT_S,
    BatchUnsupportedError,
    PlacementApply,
)
from moecomm.runtime.placement_views import Move, RebalanceReport, ServerView, imbalance
from moecomm.runtime.placement_watch import REDUNDANCY_WATCH_S, SAFETY_POLL_S, RedundancyWatch

log = logging.getLogger("moecomm.placement")

WEIGHT_SOURCES = ("peer", "checkpoint")
# Load windows kept for the placement decision, oldest first (combine_windows weighs recent
# windows more): one window of a bursty load should not move experts on its own.
DEFAULT_WINDOWS = 4
# Fewer tokens than this in the combined windows say nothing about the load: no re-placement.
MIN_WINDOW_TOKENS = 256


class PlacementController(PlacementApply, RedundancyWatch):
    """Re-places experts over live expert servers. `servers` is a list of control URLs or a
    callable returning the current ones (a front end passes its client's live servers).

    weights_from: "checkpoint" (the default: measured faster, docs/placement.md) reads the
    target's checkpoint first and falls back to a peer; "peer" pulls a replica's weights from a
    server that hosts it (over the transport), falling back to the target's checkpoint.

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
        weights_from: str = "checkpoint",
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
        report.imbalance_before = imbalance(before, weights)
        report.imbalance_after = imbalance(after, weights)
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
