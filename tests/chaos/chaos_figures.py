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
_LISTS = ("reroute_after_kill_ms", "reroute_after_stop_ms", "stop_overrun_ms")
# Per server kill: what its reroute time is made of (chaos_trial.Trial._reroute_detail).
_DETAIL = "reroute_after_kill"
# The slowest reroutes after a kill are listed with their parts: a tail is explained, not just
# stated.
SLOWEST_SHOWN = 3


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
        kills = [{"seed": t["seed"], **d} for t in self.trials for d in t.get(_DETAIL, [])]
        # A kill no client re-routed around: every client connected after it (and left the dead
        # server out), or none was running. Counted, so that n above is read against it.
        out["kills_not_rerouted"] = sum(d["ms"] is None for d in kills)
        measured = sorted((d for d in kills if d["ms"] is not None), key=lambda d: -d["ms"])
        out["slowest_reroutes"] = measured[:SLOWEST_SHOWN]
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
            f"p99 {kill['p99']} ms max {kill['max']} ms (n={kill['n']}, "
            f"{s['kills_not_rerouted']} kills not re-routed: no client used the server after "
            f"them); after SIGSTOP p50 {stop['p50']} ms p99 {stop['p99']} ms "
            f"max {stop['max']} ms (n={stop['n']})",
            *(
                f"  slow: seed {d['seed']} {d['ms']} ms by {d['client']}: dispatched at "
                f"{d['sent_ms']} ms, server evicted at {d['evicted_ms']} ms; waited for a CPU "
                f"{d['runqueue_ms']} ms, held by SIGSTOP {d['frozen_ms']} ms"
                for d in s["slowest_reroutes"]
            ),
            f"SIGSTOP held minus planned hold: p50 {s['stop_overrun_ms']['p50']} ms, "
            f"max {s['stop_overrun_ms']['max']} ms (n={s['stop_overrun_ms']['n']}; below 0: "
            "resumed when the trial ended)",
        ]

    def write_json(self) -> str | None:
        path = json_path()
        if not path or not self.trials:
            return None
        with open(path, "w") as f:
            json.dump({"summary": self.summary(), "trials": self.trials}, f, indent=1)
        return path


def json_path() -> str | None:
    """Where the chaos figures go as JSON ($MOECOMM_CHAOS_JSON; read here only), or None."""
    return os.environ.get(JSON_ENV) or None


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


# One collector per pytest process: the tests add to it, the terminal summary prints it.
FIGURES = Figures()
