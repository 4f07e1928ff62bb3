"""What a chaos trial does, drawn from its seed alone: the client processes and their runs, and
the faults (kill -9 or SIGSTOP of a server or a client) with the point at which each strikes.

A fault strikes when the trial's clients together have completed a drawn number of requests, so
it lands mid-traffic on a fast machine and a slow one alike; the timing inside a request is
what the processes make of it (that is the point of the test)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from chaos_model import NUM_SERVERS, rng_seed

# Client ids of the trial: each is reused by every process that replaces the previous one.
CLIENT_IDS = (7, 8)
# Processes per client id, one after the other (more are added for each one killed).
GENERATIONS = 2
# Connect ... disconnect runs per process, and steps (two micro-batches each) per run.
RUNS_PER_PROCESS = (1, 2)
STEPS_PER_RUN = (4, 12)
# A replacement for a killed process does one short run: it proves the id can be taken over.
REPLACEMENT_STEPS = (3, 8)
# Client deadline per request: a SIGSTOPped server is failed over after this long.
CLIENT_TIMEOUT_S = 1.5
# Stop lengths: some shorter than the deadline (the late answer is still taken), some longer.
SERVER_STOP_S = (0.3, 2.5)
CLIENT_STOP_S = (0.2, 2.0)
# Longer than the longest server stop plus one deadline: a stopped server is used again only
# after it resumed, and then it must answer right.
EVICT_S = SERVER_STOP_S[1] + CLIENT_TIMEOUT_S + 0.5
# Share of trials with a server fault (one per trial: every expert has two replicas, so a second
# server down at once would make requests unservable by design, not by a bug).
SERVER_FAULT_SHARE = 0.9
CLIENT_FAULTS = (0, 2)
# Faults strike before this share of the planned requests has completed, so traffic follows.
FAULT_WINDOW = 0.7
# A fault waits up to this long after its trigger: lands at a random point of a request.
FAULT_JITTER_S = 0.004
# Emulated attention compute of a client between steps.
THINK_S = 0.004


@dataclass(frozen=True)
class Fault:
    at: int  # strikes once this many requests completed (all clients together)
    target: str  # "server" or "client"
    index: int  # server index, or index into CLIENT_IDS
    action: str  # "kill" (SIGKILL) or "stop" (SIGSTOP, SIGCONT after hold_s)
    hold_s: float = 0.0
    jitter_s: float = 0.0

    def describe(self) -> str:
        who = f"server {self.index}" if self.target == "server" else f"client {self.index}"
        hold = f" for {self.hold_s:.2f} s" if self.action == "stop" else ""
        return f"{self.action} {who}{hold} at request {self.at}"


@dataclass
class TrialPlan:
    seed: int
    # client index -> runs (steps per run) of each process in turn
    processes: dict[int, list[tuple[int, ...]]]
    faults: list[Fault] = field(default_factory=list)

    @property
    def planned_requests(self) -> int:
        return sum(2 * sum(runs) for procs in self.processes.values() for runs in procs)

    def replacement_runs(self, client: int, generation: int) -> tuple[int, ...]:
        """Runs of the process that replaces a killed one (same id, new process)."""
        rng = random.Random(rng_seed("replacement", self.seed, client, generation))
        return (rng.randint(*REPLACEMENT_STEPS),)

    def describe(self) -> str:
        procs = "; ".join(f"client {c}: {runs}" for c, runs in self.processes.items())
        faults = ", ".join(f.describe() for f in self.faults) or "no fault"
        return f"seed {self.seed}: {procs}; {faults}"


def plan_trial(seed: int, faults: bool = True) -> TrialPlan:
    rng = random.Random(rng_seed("plan", seed))
    processes = {
        c: [
            tuple(rng.randint(*STEPS_PER_RUN) for _ in range(rng.randint(*RUNS_PER_PROCESS)))
            for _ in range(GENERATIONS)
        ]
        for c in range(len(CLIENT_IDS))
    }
    plan = TrialPlan(seed, processes)
    if not faults:
        return plan
    window = max(1, int(plan.planned_requests * FAULT_WINDOW))

    def draw(target: str, index: int, stop_s: tuple[float, float]) -> Fault:
        action = rng.choice(("kill", "stop"))
        hold = rng.uniform(*stop_s) if action == "stop" else 0.0
        at = rng.randint(1, window)
        return Fault(at, target, index, action, hold, rng.uniform(0.0, FAULT_JITTER_S))

    if rng.random() < SERVER_FAULT_SHARE:
        plan.faults.append(draw("server", rng.randrange(NUM_SERVERS), SERVER_STOP_S))
    for _ in range(rng.randint(*CLIENT_FAULTS)):
        plan.faults.append(draw("client", rng.randrange(len(CLIENT_IDS)), CLIENT_STOP_S))
    plan.faults.sort(key=lambda f: f.at)
    return plan
