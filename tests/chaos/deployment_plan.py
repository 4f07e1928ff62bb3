"""What a whole-deployment chaos trial does, drawn from its seed alone: which processes of the
deployment are hit (an expert server, a pipeline stage of the front end, the membership
monitor), how (SIGKILL, or SIGSTOP then SIGCONT), when (seconds into the trial's traffic) and
for how long (a killed server or monitor is started again after `hold_s`; a stopped process is
resumed after it). The traffic itself is drawn from the seed as well (deployment_client)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Targets of a fault. At most one fault per target in a trial: every expert is on two of the
# three servers, so a second server down at once would leave experts unserved by design (not
# a bug), and the front end replaces a pipeline at most MAX_RESTARTS_PER_STEP times per step.
TARGETS = ("server", "stage", "monitor")
NUM_SERVERS = 3
NUM_STAGES = 2
# Seconds of traffic per trial; faults strike in the first FAULT_WINDOW_S of it, so traffic
# goes on around and after each fault (and its restart or resume).
TRAFFIC_S = 6.0
FAULT_WINDOW_S = (0.3, 3.5)
# How long a stopped process stays stopped. A server: around the front end's expert deadline
# (CLIENT_TIMEOUT_S below), so some stops fail over and some answer late. A stage: around the
# driver's STOPPED_DEADLINE_S (1 s), so some are replaced and some only slow a step. The
# monitor: around its lease (SERVING_TTL_S = 2 s), so some stops outlive every lease.
STOP_S = {"server": (0.3, 2.5), "stage": (0.3, 2.5), "monitor": (0.5, 4.0)}
# A killed server or monitor is started again after this long (a stage is replaced by the
# front end itself, so it has no restart of ours).
RESTART_AFTER_S = {"server": (0.5, 2.5), "monitor": (0.5, 4.0)}
# The front end's expert deadline (--timeout): a stopped server is failed over after this long.
CLIENT_TIMEOUT_S = 1.5
# Faults per trial: at least one, at most one per target.
FAULTS_PER_TRIAL = (1, len(TARGETS))


def rng_seed(*parts) -> int:
    """A stable integer seed from `parts` (str hash is randomised per process)."""
    out = 0
    for p in parts:
        for ch in str(p):
            out = (out * 131 + ord(ch)) % (2**61 - 1)
        out = (out * 131 + 7) % (2**61 - 1)
    return out


@dataclass(frozen=True)
class DeployFault:
    at_s: float  # seconds into the trial's traffic
    target: str  # "server", "stage" or "monitor"
    index: int  # server index or stage index (0 for the monitor)
    action: str  # "kill" (SIGKILL) or "stop" (SIGSTOP, SIGCONT after hold_s)
    hold_s: float  # stop: time stopped; kill of a server or the monitor: time until restarted

    def describe(self) -> str:
        who = "the monitor" if self.target == "monitor" else f"{self.target} {self.index}"
        if self.action == "stop":
            tail = f" for {self.hold_s:.2f} s"
        elif self.target == "stage":
            tail = ""
        else:
            tail = f", restarted {self.hold_s:.2f} s later"
        return f"{self.action} {who} at {self.at_s:.2f} s{tail}"


@dataclass
class DeployPlan:
    seed: int
    faults: list[DeployFault] = field(default_factory=list)

    def describe(self) -> str:
        return f"seed {self.seed}: " + (", ".join(f.describe() for f in self.faults) or "no fault")


def plan_deployment_trial(seed: int) -> DeployPlan:
    rng = random.Random(rng_seed("deployment", seed))
    targets = rng.sample(TARGETS, rng.randint(*FAULTS_PER_TRIAL))
    plan = DeployPlan(seed)
    for target in targets:
        action = rng.choice(("kill", "stop"))
        index = {"server": NUM_SERVERS, "stage": NUM_STAGES, "monitor": 1}[target]
        index = rng.randrange(index)
        at = rng.uniform(*FAULT_WINDOW_S)
        if action == "stop":
            hold = rng.uniform(*STOP_S[target])
        else:
            hold = rng.uniform(*RESTART_AFTER_S[target]) if target in RESTART_AFTER_S else 0.0
        plan.faults.append(DeployFault(round(at, 3), target, index, action, round(hold, 3)))
    plan.faults.sort(key=lambda f: f.at_s)
    return plan
