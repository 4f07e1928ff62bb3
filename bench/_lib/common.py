"""The one timing helper and the one bytes/bandwidth definition used by every benchmark.

Definitions (used everywhere in bench/):
- A *sample* is the wall time of one call, taken with time.perf_counter_ns().
- We report medians and p99 over samples, never means: these machines are noisy.
- Bandwidth = bytes moved / median time, in GB/s (10^9 bytes per second). "Bytes moved" is
  stated by each benchmark next to its table (for a round trip: request + response payload).
- Ratios are always "contender time / reference time": > 1 means slower than the reference.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    name: str
    samples_ns: list[int] = field(repr=False)
    bytes_moved: int = 0

    @property
    def median_ns(self) -> float:
        return percentile(self.samples_ns, 50)

    @property
    def p99_ns(self) -> float:
        return percentile(self.samples_ns, 99)

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.median_ns if self.bytes_moved and self.median_ns else 0.0

    def summary(self) -> dict:
        return {
            "name": self.name,
            "n": len(self.samples_ns),
            "median_us": self.median_ns / 1e3,
            "p99_us": self.p99_ns / 1e3,
            "bytes_moved": self.bytes_moved,
            "gbps": self.gbps,
        }


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not samples:
        return math.nan
    s = sorted(samples)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return float(s[k])


def time_calls(fn: Callable[[], object], iters: int, warmup: int = 10) -> list[int]:
    """Wall time of each of `iters` calls of fn, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    clock = time.perf_counter_ns
    for _ in range(iters):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """rows: dicts; columns: (key, header, format spec)."""
    headers = [h for _, h, _ in columns]
    cells = [
        [format(r.get(k, ""), f) if r.get(k) is not None else "-" for k, _, f in columns]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([line, sep, *body])


def machine_info() -> dict:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = {"machine": machine_info(), **payload}
    with open(path, "w") as f:
        json.dump(
            payload,
            f,
            indent=2,
            default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o),
        )
    print(f"wrote {path}")


def gloo_round_trip(decode: bool, request, response, ping, pong) -> Callable[[], None]:
    """One torch.distributed round trip as rank 0 to rank 1: the `request` tensors there and
    `response` back (decode size), or `ping` there and `pong` back (signal-only)."""
    import torch.distributed as dist

    def once():
        if decode:
            for t in request:
                dist.send(t, 1)
            dist.recv(response, 1)
        else:
            dist.send(ping, 1)
            dist.recv(pong, 1)

    return once
