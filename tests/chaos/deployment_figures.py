"""Figures of the whole-deployment chaos trials, summed over a run: printed at the end of the
pytest run and written with the other chaos figures to $MOECOMM_CHAOS_JSON (conftest.py)."""

from __future__ import annotations

import json

from chaos_figures import json_path, percentile

_SUMMED = (
    "requests",
    "streamed",
    "failed",
    "wrong",
    "stage_recoveries_standby",
    "stage_recoveries_new",
    "failovers",
    "request_errors_metric",
    "server_kills",
    "server_stops",
    "stage_kills",
    "stage_stops",
    "monitor_kills",
    "monitor_stops",
    "skipped",
)


class DeployFigures:
    def __init__(self):
        self.trials: list[dict] = []

    def add(self, seed: int, plan: str, passed: bool, wall_s: float, figures: dict) -> None:
        self.trials.append(
            {"seed": seed, "plan": plan, "passed": passed, "wall_s": round(wall_s, 2), **figures}
        )

    def summary(self) -> dict:
        t = self.trials
        out = {
            "trials": len(t),
            "passed": sum(x["passed"] for x in t),
            "failed_trials": [x["seed"] for x in t if not x["passed"]],
            "wall_s": round(sum(x["wall_s"] for x in t), 2),
        }
        for k in _SUMMED:
            out[k] = sum(x.get(k, 0) for x in t)
        # A request lost: failed, answered wrong, or never answered (a trial that aborted).
        out["lost"] = out["failed"] + out["wrong"]
        rec = [s for x in t for s in x.get("stage_recovery_s", [])]
        lat = [x["latency_max_s"] for x in t if x.get("latency_max_s") is not None]
        out["stage_recovery_s"] = {
            "n": len(rec),
            "p50": _r(percentile(rec, 50)),
            "p99": _r(percentile(rec, 99)),
            "max": _r(max(rec) if rec else None),
        }
        out["slowest_request_s"] = {"p50": _r(percentile(lat, 50)), "max": _r(max(lat or [0]))}
        return out

    def write_partial(self) -> None:
        """After each trial of a long run: the figures so far at $MOECOMM_CHAOS_JSON, so a run
        cut short still leaves them (the end of the run writes the file again, complete)."""
        path = json_path()
        if path and self.trials:
            with open(path, "w") as f:
                json.dump({"deployment": {"summary": self.summary(), "trials": self.trials}}, f)

    def lines(self) -> list[str]:
        s = self.summary()
        rec = s["stage_recovery_s"]
        return [
            f"deployment trials {s['trials']}, passed {s['passed']} (failed: "
            f"{s['failed_trials'] or 'none'}), {s['wall_s']} s",
            f"requests {s['requests']} ({s['streamed']} streamed); lost {s['lost']} "
            f"(failed {s['failed']}, wrong {s['wrong']})",
            f"faults: server kills {s['server_kills']}, stops {s['server_stops']}; stage kills "
            f"{s['stage_kills']}, stops {s['stage_stops']}; monitor kills {s['monitor_kills']}, "
            f"stops {s['monitor_stops']}; skipped {s['skipped']} (victim gone already)",
            f"stage recoveries (/metrics): standby {s['stage_recoveries_standby']}, new "
            f"{s['stage_recoveries_new']}; recovery time p50 {rec['p50']} s p99 {rec['p99']} s "
            f"max {rec['max']} s (n={rec['n']}); expert failovers (/metrics) {s['failovers']}",
            f"slowest request per trial: median {s['slowest_request_s']['p50']} s, max "
            f"{s['slowest_request_s']['max']} s",
        ]


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


# One collector per pytest process: the tests add to it, the terminal summary prints it.
DEPLOY_FIGURES = DeployFigures()
