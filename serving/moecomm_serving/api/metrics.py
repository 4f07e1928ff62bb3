"""Serving metrics in the Prometheus text exposition format (no client library needed).

Latencies are histograms in seconds (``*_bucket``/``*_sum``/``*_count``), so a scraper can
compute any quantile over any window:

- TTFT: request arrival at the front end -> its first token left the engine;
- ITL: gap between two consecutive tokens of one request (one sample per gap);
- TPOT: per request, ``(E2E - TTFT) / (output tokens - 1)`` (requests with >= 2 tokens);
- E2E: arrival -> last token.

Plus counters (requests by outcome, prompt and generated tokens, failovers of the experts
backend, replacements of lost pipeline stages by kind), gauges (queue depth, running requests,
generated tokens/s over a sliding window).
Everything is updated under one lock: the engine thread and the event loop both write.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

PREFIX = "moecomm"
# Bucket upper bounds (s): per-token latencies on CPU run from ~1 ms (tiny model) to seconds.
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# Label values of the stage-recovery counter: the standby pipeline took over, or a new one
# was started (moecomm_serving.engine.pipeline.Recovery.standby). Both are always rendered, so a
# scraper sees a 0 before the first recovery instead of a missing series.
RECOVERY_KINDS = ("standby", "new")
# Window of the tokens/s gauge: long enough to smooth step jitter, short enough to track load.
THROUGHPUT_WINDOW_S = 10.0


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS_S):
        self.name, self.help = name, help_text
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            total += n
            out.append(f'{self.name}_bucket{{le="{bound}"}} {total}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{self.name}_sum {self.sum}")
        out.append(f"{self.name}_count {self.count}")
        return out


def _scalar(kind: str, name: str, help_text: str, value: float, labels: str = "") -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{labels} {value}"]


class ServingMetrics:
    """All front-end metrics. ``gauges`` are read at scrape time (queue depth, failovers...)."""

    def __init__(
        self,
        queue_depth: Callable[[], int],
        running: Callable[[], int],
        failovers: Callable[[], int],
        stage_recoveries: Callable[[], dict[str, int]] | None = None,
        prefix_cache=None,
        extra: Callable[[], list[tuple]] | None = None,
    ):
        self._lock = threading.Lock()
        # More series read at scrape time: rows of (kind, full name, help, value[, labels]), the
        # prefill/decode hand-offs of a front end with a role or a router's retries.
        self._extra = extra or list
        self._queue_depth, self._running, self._failovers = queue_depth, running, failovers
        # Replacements of the pipeline stages by kind (RECOVERY_KINDS); none without stages.
        self._stage_recoveries = stage_recoveries or dict
        # The engine's PrefixCache (moecomm_serving.kv.prefix_cache), or None: no series then.
        self._prefix_cache = prefix_cache
        p = PREFIX
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Arrival to first token.")
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "Gap between two tokens.")
        self.tpot = Histogram(
            f"{p}_time_per_output_token_seconds", "Per request (E2E - TTFT) / (tokens - 1)."
        )
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "Arrival to last token.")
        self.requests: dict[str, int] = {"success": 0, "error": 0, "cancelled": 0}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) for tokens/s

    def on_token(self, request_gap_s: float | None, now: float) -> None:
        """One generated token; `request_gap_s` is the gap since this request's previous one."""
        with self._lock:
            self.generation_tokens += 1
            self._recent.append((now, 1))
            # Pruned here too, not only at scrape time: a front end nobody scrapes kept every
            # token it ever generated (~90 B each, ~1.3 kB per request of the front-end soak's
            # mix: its RSS growth, bench/serving/frontend_memory.py).
            self._prune(now)
            if request_gap_s is not None:
                self.itl.observe(request_gap_s)

    def on_first_token(self, ttft_s: float) -> None:
        with self._lock:
            self.ttft.observe(ttft_s)

    def on_request_done(
        self, outcome: str, prompt_tokens: int, ttft_s: float | None, e2e_s: float, n_out: int
    ) -> None:
        with self._lock:
            self.requests[outcome] = self.requests.get(outcome, 0) + 1
            self.prompt_tokens += prompt_tokens
            if outcome == "success":
                self.e2e.observe(e2e_s)
                if ttft_s is not None and n_out >= 2:
                    self.tpot.observe((e2e_s - ttft_s) / (n_out - 1))

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._prune(now)
            return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def _prune(self, now: float) -> None:
        """Drops the tokens older than the window (called with the lock held)."""
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def render(self) -> str:
        p = PREFIX
        tps = self.tokens_per_second()
        with self._lock:
            lines = []
            for h in (self.ttft, self.tpot, self.itl, self.e2e):
                lines += h.render()
            name = f"{p}_requests_total"
            lines += [f"# HELP {name} Finished requests by outcome.", f"# TYPE {name} counter"]
            lines += [f'{name}{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())]
            lines += _scalar(
                "counter", f"{p}_prompt_tokens_total", "Prompt tokens.", self.prompt_tokens
            )
            lines += _scalar(
                "counter",
                f"{p}_generation_tokens_total",
                "Generated tokens.",
                self.generation_tokens,
            )
        lines += _scalar(
            "gauge",
            f"{p}_generation_tokens_per_second",
            f"Generated tokens/s over the last {THROUGHPUT_WINDOW_S:g} s.",
            tps,
        )
        lines += _scalar(
            "gauge", f"{p}_queue_depth", "Requests waiting for admission.", self._queue_depth()
        )
        lines += _scalar("gauge", f"{p}_running_requests", "Requests in flight.", self._running())
        lines += _scalar(
            "counter",
            f"{p}_failovers_total",
            "Re-sends of expert requests to a replica (AttentionClient.failovers).",
            self._failovers(),
        )
        name = f"{p}_stage_recoveries_total"
        counts = self._stage_recoveries()
        lines += [
            f"# HELP {name} Replacements of lost pipeline stages: by the standby stages kept "
            "started, or by new ones.",
            f"# TYPE {name} counter",
        ]
        lines += [f'{name}{{kind="{k}"}} {int(counts.get(k, 0))}' for k in RECOVERY_KINDS]
        if self._prefix_cache is not None:
            lines += _prefix_cache_lines(self._prefix_cache)
        lines += _extra_lines(self._extra())
        return "\n".join(lines) + "\n"


def _extra_lines(rows) -> list[str]:
    """Rows of (kind, name, help, value[, labels such as '{phase="prefill"}']); the series of one
    name share its HELP and TYPE lines (a scraper refuses them twice)."""
    out, seen = [], set()
    for kind, name, help_text, value, *labels in rows:
        if name not in seen:
            seen.add(name)
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        out.append(f"{name}{labels[0] if labels else ''} {value}")
    return out


def _prefix_cache_lines(cache) -> list[str]:
    """The prefix cache's series. Its counters are written by the engine thread only; a
    scrape reads each int once, so a series is never torn (at worst one step old)."""
    p, s = f"{PREFIX}_prefix_cache", cache.stats
    per_token = cache.pool.block_bytes // cache.pool.block_tokens
    rows = [
        ("counter", "lookups_total", "Prompts looked up in the prefix cache.", s.lookups),
        ("counter", "hits_total", "Prompts that reused at least one cached block.", s.hits),
        ("counter", "query_tokens_total", "Prompt tokens looked up.", s.query_tokens),
        ("counter", "hit_tokens_total", "Prompt tokens served from the cache.", s.hit_tokens),
        ("gauge", "hit_rate", "hit_tokens_total / query_tokens_total.", s.hit_rate),
        (
            "counter",
            "hit_bytes_total",
            "KV bytes reused instead of computed.",
            s.hit_tokens * per_token,
        ),
        ("gauge", "bytes", "KV bytes the prefix cache holds.", cache.bytes),
        ("gauge", "capacity_bytes", "The prefix cache's byte budget.", cache.max_bytes),
        (
            "counter",
            "evicted_blocks_total",
            "Blocks evicted (least recently used).",
            s.evicted_blocks,
        ),
        (
            "counter",
            "saved_prefill_seconds_total",
            "TTFT saved (estimate): skipped prefill tokens times the marginal forward "
            "seconds per token, fitted over recent engine steps.",
            s.saved_prefill_s,
        ),
    ]
    out = []
    for kind, name, help_text, value in rows:
        out += _scalar(kind, f"{p}_{name}", help_text, value)
    return out
