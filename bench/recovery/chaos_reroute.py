"""Kill -> first re-routed completion in the chaos trials (tests/chaos): the old reroute path
beside the new one, and the trial loop before and after its fix, side by side in one run.

Variants (each seed runs under every variant asked for, in alternating order):
  poll     the old reroute path: a dead shm peer is seen by the 20 ms /proc liveness poll
           (MOECOMM_SHM_DEATH_WATCH=poll) and its share re-sent once every server of the step
           answered or failed (MOECOMM_RESEND=after_step);
  watch    death seen at once through the peer's life word, re-sent after the step (what the
           earlier notice alone buys);
  at_once  the library's default: life word, and the share re-sent to a replica's spare slot the
           moment the death is seen, while the step's other answers are awaited;
  inline / deferred   the trial loop before / after the fix below (library defaults).

The variants' settings reach every process of a trial through the environment (the trial
spawns its servers and clients after it is set).

What replaying seed 86 (399 ms in the 101-trial run) showed: the trial's event loop, which
strikes the faults and ends each SIGSTOP on time, computed the fault-free reference of every
answer as it arrived. On a loaded 2-core machine each such forward pass took 0.05-2 s (two
OpenMP threads fighting the trial's own processes), so seed 86's 0.81 s client stop struck
next to the kill instead of 35 requests before it and lasted 4 s, and faults in general
struck late, often when no client used the victim any more (a kill nobody re-routed around
is not counted). "inline" is that loop (the reference checked as each answer arrives);
"deferred" is the fixed one (answers recorded, checked once every process is gone). Each
seed runs under both, in alternating order, so the two see the same machine.

Per server kill the parts of its reroute time are kept (chaos_trial.Trial._reroute_detail):
when the re-routed request was dispatched, when the dead server was evicted, how long the
client waited for a CPU, how long it was held by SIGSTOP. Load average is recorded with every
trial: this machine is shared, so compare the two variants within one run only.

Usage: python bench/recovery/chaos_reroute.py [--seeds N] [--variants poll,at_once]
       [--json bench/results/chaos_reroute.json]
The reroute goal's measurement: `python bench/recovery/chaos_reroute.py --seeds 100 --variants
poll,at_once --json bench/results/chaos_reroute_100.json` on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests", "chaos"), os.path.join(ROOT, "tests")]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts

# As the chaos conftest does: poison released slots in every process the trials start.
os.environ["MOECOMM_POISON_SLOTS"] = "1"

from _lib.common import format_table, write_json  # noqa: E402
from chaos_figures import percentile  # noqa: E402
from chaos_model import BatchKey, Reference  # noqa: E402
from chaos_plan import plan_trial  # noqa: E402
from chaos_trial import Trial, run_trial  # noqa: E402

# variant -> (trial loop, environment of every process of its trials)
VARIANTS = {
    "poll": ("deferred", {"MOECOMM_SHM_DEATH_WATCH": "poll", "MOECOMM_RESEND": "after_step"}),
    "watch": ("deferred", {"MOECOMM_SHM_DEATH_WATCH": "futex", "MOECOMM_RESEND": "after_step"}),
    "at_once": ("deferred", {"MOECOMM_SHM_DEATH_WATCH": "futex", "MOECOMM_RESEND": "at_once"}),
    "inline": ("inline", {}),
    "deferred": ("deferred", {}),
}
DEFAULT_VARIANTS = ("poll", "at_once")
# Seeds are taken in order from 1 up, keeping those whose plan kills a server (46 of 1..100).
MAX_SEED = 1000


class InlineTrial(Trial):
    """The loop before the fix: every answer checked against the reference as it arrives."""

    def _handle(self, cp, msg) -> None:
        super()._handle(cp, msg)
        if msg[0] == "done":
            self.answers.pop()  # checked here instead of after the trial
            _, key, _, _, _, y = msg
            wrong = self.ref.mismatch(BatchKey(*key), y)
            if wrong is not None:
                self.problems.append(f"{cp.name} request {key[3:]}: wrong result, {wrong}")


def kill_seeds(count: int) -> list[int]:
    seeds = []
    for seed in range(1, MAX_SEED):
        plan = plan_trial(seed)
        if any(f.target == "server" and f.action == "kill" for f in plan.faults):
            seeds.append(seed)
            if len(seeds) == count:
                break
    return seeds


def summarize(values: list[float | None]) -> dict:
    values = [v for v in values if v is not None]  # runqueue_ms: None without schedstat
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10, help="how many kill seeds (each run twice)")
    ap.add_argument("--only", default="", help="comma-separated seeds instead of the first N")
    ap.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"which variants to run (comma-separated, of {', '.join(VARIANTS)})",
    )
    ap.add_argument(
        "--budget-min",
        type=float,
        default=None,
        help="start no new seed after this many minutes (the JSON lists the seeds that ran)",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    variants = tuple(v for v in a.variants.split(",") if v)
    unknown = set(variants) - set(VARIANTS)
    if unknown or not variants:
        ap.error(f"--variants: one or more of {', '.join(VARIANTS)}, got {a.variants!r}")
    command = "python bench/recovery/chaos_reroute.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    seeds = [int(s) for s in a.only.split(",") if s] or kill_seeds(a.seeds)
    reference = Reference()
    trials = []
    ran: list[int] = []
    deadline = None if a.budget_min is None else time.monotonic() + 60.0 * a.budget_min
    for i, seed in enumerate(seeds):
        if deadline is not None and time.monotonic() > deadline:
            print(f"--budget-min {a.budget_min} spent: {len(ran)} of {len(seeds)} seeds ran")
            break
        ran.append(seed)
        order = variants if i % 2 == 0 else variants[::-1]
        for variant in order:
            load = os.getloadavg()[0]
            loop, env = VARIANTS[variant]
            cls = InlineTrial if loop == "inline" else Trial
            with _environment(env):
                r = run_trial(seed, plan_trial(seed), reference, trial_cls=cls)
            f = r.figures
            trials.append(
                {
                    "seed": seed,
                    "variant": variant,
                    "passed": not r.problems,
                    "problems": r.problems[:5],
                    "wall_s": round(r.wall_s, 2),
                    "load_1min_before": load,
                    "load_1min_after": os.getloadavg()[0],
                    "lost": f["lost"],
                    "reroute_after_kill": f["reroute_after_kill"],
                    "reroute_after_stop_ms": f["reroute_after_stop_ms"],
                    "stop_overrun_ms": f["stop_overrun_ms"],
                }
            )
            kills = [d["ms"] for d in f["reroute_after_kill"]]
            print(
                f"seed {seed:3d} {variant:8s} kill->reroute {kills} ms, stop overrun "
                f"{f['stop_overrun_ms']} ms, load {load:.1f}, {r.wall_s:.1f} s"
                + ("" if not r.problems else f"  PROBLEMS: {r.problems[:2]}"),
                flush=True,
            )
    out = {
        "command": command,
        "seeds": ran,
        "seeds_asked": len(seeds),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "variants": {v: {"loop": VARIANTS[v][0], "env": VARIANTS[v][1]} for v in variants},
    }
    for variant in variants:
        mine = [t for t in trials if t["variant"] == variant]
        kills = [d for t in mine for d in t["reroute_after_kill"]]
        out[variant] = {
            "reroute_after_kill_ms": summarize([d["ms"] for d in kills if d["ms"] is not None]),
            "kills_not_rerouted": sum(d["ms"] is None for d in kills),
            "runqueue_ms": summarize([d["runqueue_ms"] for d in kills if d["ms"] is not None]),
            "frozen_ms": summarize([d["frozen_ms"] for d in kills if d["ms"] is not None]),
            # When the dead server was evicted by the client that re-routed first: the notice.
            "evicted_ms": summarize([d["evicted_ms"] for d in kills if d["ms"] is not None]),
            "stop_overrun_ms": summarize([v for t in mine for v in t["stop_overrun_ms"]]),
            "load_1min_median": percentile([t["load_1min_before"] for t in mine], 50),
            "failed_trials": [t["seed"] for t in mine if not t["passed"]],
            "lost": sum(t["lost"] for t in mine),
        }
        s = out[variant]
        k = s["reroute_after_kill_ms"]
        print(
            f"{variant:8s}: kill -> first re-routed completion p50 {k['p50']} p99 {k['p99']} "
            f"max {k['max']} ms (n={k['n']}, {s['kills_not_rerouted']} not re-routed); "
            f"stop overrun max {s['stop_overrun_ms']['max']} ms; load median "
            f"{s['load_1min_median']}; lost {s['lost']}; failed {s['failed_trials']}"
        )
    base = variants[0]
    rows = []
    for variant in variants:
        k = out[variant]["reroute_after_kill_ms"]
        b = out[base]["reroute_after_kill_ms"]
        rows.append(
            {
                "variant": variant,
                "n": k["n"],
                "p50": k["p50"],
                "p99": k["p99"],
                "max": k["max"],
                "p50_ratio": _ratio(k, b, "p50"),
                "p99_ratio": _ratio(k, b, "p99"),
                "evicted_p99": out[variant]["evicted_ms"]["p99"],
                "load": out[variant]["load_1min_median"],
            }
        )
    out["table"] = rows
    print(
        format_table(
            rows,
            [
                ("variant", "variant", "s"),
                ("n", "kills", "d"),
                ("p50", "p50 ms", ".1f"),
                ("p99", "p99 ms", ".1f"),
                ("max", "max ms", ".1f"),
                ("p50_ratio", f"p50/{base}", ".2f"),
                ("p99_ratio", f"p99/{base}", ".2f"),
                ("evicted_p99", "evicted p99 ms", ".1f"),
                ("load", "load", ".1f"),
            ],
        )
    )
    write_json(a.json, {**out, "trials": trials})
    return 0


def _ratio(k: dict, base: dict, q: str) -> float | None:
    return round(k[q] / base[q], 2) if k[q] is not None and base[q] else None


@contextlib.contextmanager
def _environment(env: dict):
    """`env` set in this process (and so in every process a trial spawns) while inside."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


if __name__ == "__main__":
    sys.exit(main())
