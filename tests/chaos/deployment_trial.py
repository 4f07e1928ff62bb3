"""One whole-deployment chaos trial: OpenAI-API traffic through the front end for TRAFFIC_S
seconds while the plan's faults strike the deployment's processes; then the deployment is made
whole again (killed servers and monitor were restarted, stopped ones resumed) and checked:
every request answered completely with the fault-free greedy tokens, the front end healthy and
answering, the monitor listing every server, and /metrics counting what happened."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass

from deployment import Deployment
from deployment_client import PROMPTS, REQUEST_TIMEOUT_S, Traffic
from deployment_plan import TRAFFIC_S, DeployFault, DeployPlan
from proc_helpers import stop_process

# Event-loop tick: how late a fault, a SIGCONT or a restart may be.
POLL_S = 0.01
# The last requests of a trial may start just before the end of the traffic and wait for a
# stage replacement: their deadline plus slack.
DRAIN_S = REQUEST_TIMEOUT_S + 10.0
# A killed server's or monitor's restart runs in a thread (it waits for the process's start-up
# line): this long at most.
RESTART_JOIN_S = 120.0
# Counters of the front end's /metrics the trials read (labels included).
RECOVERY_STANDBY = 'moecomm_stage_recoveries_total{kind="standby"}'
RECOVERY_NEW = 'moecomm_stage_recoveries_total{kind="new"}'
FAILOVERS = "moecomm_failovers_total"
REQUEST_ERRORS = 'moecomm_requests_total{outcome="error"}'
MAX_PROBLEMS_PER_KIND = 5


@dataclass
class DeployResult:
    seed: int
    plan: str
    problems: list[str]
    figures: dict
    wall_s: float


class DeployTrial:
    def __init__(self, dep: Deployment, plan: DeployPlan, expected: dict[int, list[int]]):
        self.dep, self.plan, self.expected = dep, plan, expected
        self.problems: list[str] = []
        self.struck: list[tuple[float, DeployFault, int]] = []  # (time, fault, victim pid)
        # Pending (when, what, action) follow-ups: SIGCONT of a stopped process or a restart.
        self.later: list[tuple[float, str, object]] = []
        self.restarts: list[threading.Thread] = []
        self.skipped: list[DeployFault] = []  # faults whose victim was gone already

    # ------------------------------------------------------------------ faults
    def strike(self, f: DeployFault) -> None:
        dep = self.dep
        if f.target == "server":
            pid = dep.servers[f.index].pid
        elif f.target == "monitor":
            pid = dep.monitor.proc.pid
        else:
            pid = dep.stage_pids()[f.index]
        now = time.monotonic()
        try:
            if f.action == "kill":
                os.kill(pid, signal.SIGKILL)
            else:
                stop_process(pid)
        except (ProcessLookupError, FileNotFoundError):
            # Only a stage can be gone: one the front end replaced a moment before (its new
            # pids not printed yet). Servers and the monitor are ours, and up at every strike.
            if f.target != "stage":
                raise
            self.skipped.append(f)
            return
        if f.action == "stop":
            self.later.append((now + f.hold_s, "resume", pid))
        elif f.target == "server":
            self.later.append((now + f.hold_s, "restart", lambda: dep.restart_server(f.index)))
        elif f.target == "monitor":
            self.later.append((now + f.hold_s, "restart", dep.restart_monitor))
        self.struck.append((now, f, pid))

    def _follow_up(self, kind: str, what) -> None:
        if kind == "resume":
            # The front end may have killed a stopped stage already: then it is gone.
            with contextlib.suppress(ProcessLookupError):
                os.kill(what, signal.SIGCONT)
            return
        t = threading.Thread(target=self._restart, args=(what,), daemon=True)
        t.start()
        self.restarts.append(t)

    def _restart(self, fn) -> None:
        try:
            fn()
        except Exception as exc:  # reported with the trial, never lost in a thread
            self.problems.append(f"restart failed: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ the trial
    def run(self) -> dict:
        before = self.dep.metrics()
        restarted = self.dep.frontend.count("pipeline restarted")
        traffic = Traffic(self.dep.url, "tiny", self.plan.seed)
        t0 = time.monotonic()
        traffic.start()
        pending = list(self.plan.faults)
        try:
            while pending or self.later or time.monotonic() - t0 < TRAFFIC_S:
                now = time.monotonic()
                while pending and now - t0 >= pending[0].at_s:
                    self.strike(pending.pop(0))
                due = [x for x in self.later if x[0] <= now]
                self.later = [x for x in self.later if x[0] > now]
                for _, kind, what in due:
                    self._follow_up(kind, what)
                time.sleep(POLL_S)
        finally:
            for _, kind, what in self.later:  # an exception above: still resume / restart
                self._follow_up(kind, what)
            self.later = []
            self.problems += traffic.stop(DRAIN_S)
            for t in self.restarts:
                t.join(RESTART_JOIN_S)
        self.problems += self.dep.wait_whole()
        self.problems += self.dep.stray_stages()
        self._check_answers(traffic)
        after = self.dep.metrics()
        return self._figures(traffic, before, after, restarted, time.monotonic() - t0)

    def _check_answers(self, traffic: Traffic) -> None:
        failed = [a for a in traffic.answers if a.tokens is None]
        wrong = [a for a in traffic.answers if a.tokens is not None]
        wrong = [a for a in wrong if a.tokens != self.expected[a.prompt]]
        for a in failed[:MAX_PROBLEMS_PER_KIND]:
            kind = "streamed" if a.stream else "non-streamed"
            self.problems.append(
                f"{kind} request {a.worker}/{a.n} (prompt {a.prompt}) at "
                f"{a.started - traffic.answers[0].started:.2f} s failed: {a.error}"
            )
        for a in wrong[:MAX_PROBLEMS_PER_KIND]:
            self.problems.append(
                f"request {a.worker}/{a.n} (prompt {a.prompt!r}): tokens {a.tokens} differ from "
                f"the fault-free {self.expected[a.prompt]}"
            )
        if len(failed) + len(wrong) > 2 * MAX_PROBLEMS_PER_KIND:
            self.problems.append(f"{len(failed)} requests failed, {len(wrong)} were wrong")
        if not traffic.answers:
            self.problems.append("no request completed")
        if self.dep.frontend.popen.poll() is not None:
            self.problems.append(f"the front end exited ({self.dep.frontend.popen.returncode})")

    def _figures(self, traffic: Traffic, before: dict, after: dict, restarted: int, wall: float):
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        answers = traffic.answers
        lat = sorted(a.ended - a.started for a in answers)
        lines = self.dep.frontend.wait_output("pipeline restarted", restarted, 0)[restarted:]
        # "pipeline restarted in 1.234 s (stages ...": the front end's own recovery time.
        recovery_s = [float(ln.split(" in ", 1)[1].split(" s", 1)[0]) for ln in lines]
        struck = [f for _, f, _ in self.struck]
        return {
            "requests": len(answers),
            "streamed": sum(a.stream for a in answers),
            "failed": sum(a.tokens is None for a in answers),
            "wrong": sum(
                a.tokens is not None and a.tokens != self.expected[a.prompt] for a in answers
            ),
            "latency_max_s": round(lat[-1], 3) if lat else None,
            "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
            "stage_recoveries_standby": int(d.get(RECOVERY_STANDBY, 0)),
            "stage_recoveries_new": int(d.get(RECOVERY_NEW, 0)),
            "stage_recovery_s": recovery_s,
            "failovers": int(d.get(FAILOVERS, 0)),
            "request_errors_metric": int(d.get(REQUEST_ERRORS, 0)),
            **{
                f"{t}_{a}s": sum(f.target == t and f.action == a for f in struck)
                for t in ("server", "stage", "monitor")
                for a in ("kill", "stop")
            },
            "skipped": len(self.skipped),
            "traffic_s": round(wall, 2),
        }


def run_deployment_trial(
    dep: Deployment, plan: DeployPlan, expected: dict[int, list[int]]
) -> DeployResult:
    start = time.monotonic()
    trial = DeployTrial(dep, plan, expected)
    figures: dict = {}
    try:
        figures = trial.run()
    except Exception as exc:  # a hang or a crash of the harness: reported with the seed
        trial.problems.append(f"trial aborted: {type(exc).__name__}: {exc}")
    return DeployResult(
        plan.seed, plan.describe(), trial.problems, figures, time.monotonic() - start
    )


__all__ = ["PROMPTS", "DeployResult", "DeployTrial", "run_deployment_trial"]
