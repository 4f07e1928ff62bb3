"""What an expert server knows about its own state: counters of what it served and refused, and
whether its loop is alive. The control plane reads them for /health and /metrics; they never
read slot memory (a released slot belongs to the peer)."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from moecomm.wire.protocol import ResponseStatus, ValidateCode


def status_name(code: int) -> str:
    """A readable label for a response status or validation code (they share the wire field)."""
    for enum in (ResponseStatus, ValidateCode):
        for name, value in enum.__members__.items():
            if int(value) == code and name != "OK":
                return name.lower()
    return str(code)


@dataclass
class ServerStats:
    requests: int = 0  # answered with a result
    rejected: int = 0  # answered with an error status
    tokens: int = 0
    batches: int = 0
    busy_s: float = 0.0
    # (layer, logical expert) -> token copies served
    expert_load: dict = field(default_factory=lambda: defaultdict(int))
    rejected_by_status: Counter = field(default_factory=Counter)  # status name -> count
    # Batches whose compute raised: every request of the batch got SERVER_ERROR, the loop went on.
    batch_failures: int = 0
    dead_clients_dropped: int = 0
    last_served: float | None = None  # time.monotonic() of the last answered request

    def count_rejection(self, status: int) -> None:
        self.rejected += 1
        self.rejected_by_status[status_name(status)] += 1

    def seconds_since_last_served(self) -> float | None:
        return None if self.last_served is None else time.monotonic() - self.last_served


class LoopHealth:
    """Alive until something escapes the serving loop; then failed for good, with the reason.
    A failed server must be restarted: `failed` is the event a supervisor waits on."""

    def __init__(self):
        self.failed = threading.Event()
        self.reason = ""

    @property
    def ok(self) -> bool:
        return not self.failed.is_set()

    def fail(self, reason: str) -> None:
        if not self.failed.is_set():
            self.reason = reason
            self.failed.set()


def metrics_lines(server_id: str, stats: ServerStats, health: LoopHealth, clients: int) -> list:
    """Prometheus text lines for one server."""
    label = f'server="{server_id}"'
    counters = {
        "requests_total": stats.requests,
        "rejected_total": stats.rejected,
        "tokens_total": stats.tokens,
        "batches_total": stats.batches,
        "busy_seconds_total": round(stats.busy_s, 6),
        "batch_failures_total": stats.batch_failures,
        "dead_clients_dropped_total": stats.dead_clients_dropped,
    }
    lines = []
    for name, value in counters.items():
        lines.append(f"# TYPE moecomm_server_{name} counter")
        lines.append(f"moecomm_server_{name}{{{label}}} {value}")
    since = stats.seconds_since_last_served()
    gauges = {
        "clients": clients,
        "loop_failed": int(not health.ok),
        # -1 until the first request is served.
        "seconds_since_last_served": -1 if since is None else round(since, 3),
    }
    for name, value in gauges.items():
        lines.append(f"# TYPE moecomm_server_{name} gauge")
        lines.append(f"moecomm_server_{name}{{{label}}} {value}")
    lines.append("# TYPE moecomm_server_rejected_by_status_total counter")
    for status, n in sorted(stats.rejected_by_status.items()):
        lines.append(f'moecomm_server_rejected_by_status_total{{{label},status="{status}"}} {n}')
    lines.append("# TYPE moecomm_server_expert_tokens_total counter")
    for (layer, expert), n in sorted(stats.expert_load.items()):
        lines.append(
            f'moecomm_server_expert_tokens_total{{{label},layer="{layer}",expert="{expert}"}} {n}'
        )
    return lines
