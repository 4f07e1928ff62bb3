"""Figures of a chaos run, summed over its trials: printed at the end of the pytest run and
written as JSON to $MOECOMM_CHAOS_JSON when set."""

from __future__ import annotations

import json
import math
import os

JSON_ENV = "MOECOMM_CHAOS_JSON"
_SUMMED = (
    "requests",
    "requests_planned",
    "requests_of_surviving_clients",
    "lost",
    "abandoned_with_killed_clients",
    "failovers",
    "connects",
    "connect_retries",
    "skipped",
    "server_requests",
    "server_rejected",
    "server_kills",
    "server_stops",
    "client_kills",
    "client_stops",
)
_LISTS = ("reroute_after_kill_ms", "reroute_after_stop_ms")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile: a value that was measured, never an interpolation."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class Figures:
    def __init__(self):
        self.trials: list[dict] = []

    def add(self, seed: int, plan: str, passed: bool, wall_s: float, figures: dict) -> None:
        self.trials.append(
            {"seed": seed, "plan": plan, "passed": passed, "wall_s": round(wall_s, 2), **figures}
        )

    def summary(self) -> dict:
        out = {
            "trials": len(self.trials),
            "failed_trials": [t["seed"] for t in self.trials if not t["passed"]],
            "wall_s": round(sum(t["wall_s"] for t in self.trials), 2),
        }
        for k in _SUMMED:
            out[k] = sum(t.get(k, 0) for t in self.trials)
        for k in _LISTS:
            values = [v for t in self.trials for v in t.get(k, [])]
            out[k] = {
                "n": len(values),
                "p50": _round(percentile(values, 50)),
                "p99": _round(percentile(values, 99)),
                "max": _round(max(values) if values else None),
            }
        return out

    def lines(self) -> list[str]:
        s = self.summary()
        kill, stop = s["reroute_after_kill_ms"], s["reroute_after_stop_ms"]
        return [
            f"trials {s['trials']} (failed: {s['failed_trials'] or 'none'}), {s['wall_s']} s",
            f"requests completed {s['requests']} of {s['requests_planned']} planned; "
            f"lost {s['lost']} of {s['requests_of_surviving_clients']} of surviving clients; "
            f"abandoned with killed clients {s['abandoned_with_killed_clients']}",
            f"failovers {s['failovers']}; connects {s['connects']} "
            f"(retried {s['connect_retries']}); server requests {s['server_requests']}, "
            f"rejected {s['server_rejected']}",
            f"faults: server kills {s['server_kills']}, server stops {s['server_stops']}, "
            f"client kills {s['client_kills']}, client stops {s['client_stops']}, "
            f"skipped {s['skipped']}",
            f"fault -> first re-routed completion: after kill -9 p50 {kill['p50']} ms "
            f"p99 {kill['p99']} ms (n={kill['n']}); after SIGSTOP p50 {stop['p50']} ms "
            f"p99 {stop['p99']} ms (n={stop['n']})",
        ]

    def write_json(self) -> str | None:
        path = os.environ.get(JSON_ENV)
        if not path or not self.trials:
            return None
        with open(path, "w") as f:
            json.dump({"summary": self.summary(), "trials": self.trials}, f, indent=1)
        return path


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


# One collector per pytest process: the tests add to it, the terminal summary prints it.
FIGURES = Figures()
