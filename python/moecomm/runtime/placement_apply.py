"""How the placement controller applies a plan to the serving expert servers, over their HTTP
control routes.

Safe order: every replica to add is loaded first (weights pulled from a peer that hosts the
expert, or read from the server's own checkpoint), published, and only then are the replicas
that leave marked as leaving. Each server gets its changes as one batch: all the experts it
loads in one request (each layer's weights rebuilt once, the new table published in one epoch),
later all the experts it drops in another (one epoch), the servers in parallel. A server from
before the batch routes answers 404 and gets one request per expert instead. A leaving replica
is still served; the server frees it once every client has picked up the new table
(docs/placement.md); apply() then waits for that (the controller's converge time).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from moecomm.errors import MoecommError
from moecomm.runtime.placement_views import Move, RebalanceReport, ServerView

log = logging.getLogger("moecomm.placement")

# How long apply() waits for the servers to free the replicas that left (every client must
# first pick up the new table; an idle client is waited for at most the server's drop grace).
CONVERGE_TIMEOUT_S = 30.0
CONVERGE_POLL_S = 0.05
# Loads may take long on a real checkpoint (a DeepSeek-V3 expert is 44 MB); the HTTP deadline of
# a load is this multiple of the controller's.
LOAD_TIMEOUT_FACTOR = 6


class BatchUnsupportedError(MoecommError):
    """The server has no batch route (it is from before them): load or drop one by one."""


class PlacementApply:
    """The applying half of PlacementController (mixed into it): loads and drops over the
    servers' control routes, with the controller's HTTP client, token, deadlines, weight source
    preference and batching choice."""

    token: str
    timeout: float
    converge_timeout: float
    weights_from: str
    batched: bool
    _report_lock: threading.Lock
    _client: Callable[[], httpx.Client]
    snapshot: Callable[..., list[ServerView]]

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
        target = next((v for v in views if v.url == move.server), None)
        if target is not None and not target.checkpoint and peers:
            return [("peer", peers[0])]  # it has no checkpoint: asking it would only fail
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
