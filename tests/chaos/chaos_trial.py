"""One chaos trial with real processes: three expert servers, client processes that come and go
under reused ids, and the faults of the trial's plan, struck by this process while it reads
every answer the clients report and checks it against the in-process reference."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_any

import moecomm
from chaos_checks import probe_problems, segment_problems, server_problems
from chaos_client import GO, ClientJob, Timing, client_main
from chaos_model import HOSTED, SPEC, BatchKey, Reference
from chaos_plan import CLIENT_IDS, CLIENT_TIMEOUT_S, EVICT_S, THINK_S, Fault, TrialPlan
from moecomm import prefork
from moecomm.runtime.launch import spawn_expert_server
from proc_helpers import stop_process

# Event-loop tick: how late a fault or a SIGCONT may be, besides the jitter it was given.
POLL_S = 0.005
# A trial takes ~5-15 s (three stops of <= 2.5 s, failovers at 1.5 s deadlines); this long
# means something hangs.
TRIAL_DEADLINE_S = 90.0
JOIN_S = 10.0
# Client id of the post-trial probe: none of the trial's clients.
PROBE_CLIENT_ID = 99
# Error messages are cut to this length in the report.
MAX_REASON = 400


@dataclass
class ClientProc:
    index: int
    generation: int
    job: ClientJob
    process: mp.Process
    conn: object
    killed: bool = False
    stopped_until: float | None = None
    stop_record: list | None = None  # its entry in Trial.stops while it is stopped
    said_ready: bool = False
    said_exit: bool = False
    done: set = field(default_factory=set)
    failed: set = field(default_factory=set)

    @property
    def name(self) -> str:
        return f"client {self.job.client_id} process {self.generation}"

    def planned_keys(self) -> set:
        j = self.job
        return {
            BatchKey(j.seed, j.client_id, j.generation, run, step, micro).as_tuple()
            for run, steps in enumerate(j.runs)
            for step in range(steps)
            for micro in range(2)
        }


@dataclass
class ServerState:
    name: str
    proc: object  # ServerProcess
    killed: bool = False
    stopped_until: float | None = None
    stop_record: list | None = None  # its entry in Trial.stops while it is stopped


@dataclass
class Completion:
    t: float
    moved: int  # failovers during this combine
    evicted: tuple[str, ...]  # servers this combine evicted
    client: str  # the process that completed it
    timing: Timing


class Trial:
    def __init__(self, plan: TrialPlan, reference: Reference):
        self.plan = plan
        self.ref = reference
        self.ctx = prefork.process_context()
        self.servers: list[ServerState] = []
        self.queue = {c: list(runs) for c, runs in plan.processes.items()}
        self.generation = dict.fromkeys(plan.processes, 0)
        self.running: dict[int, ClientProc] = {}
        self.standby: dict[int, ClientProc] = {}
        self.exiting: list[ClientProc] = []  # said "exit", not gone yet
        self.unfinished: list[int] = []  # pids of client processes killed by the cleanup
        self.finished: list[ClientProc] = []
        self.pending = list(plan.faults)
        self.problems: list[str] = []
        self.completions: list[Completion] = []
        self.answers: list[tuple[str, tuple, bytes]] = []  # (client process, key, result)
        self.faults: list[tuple[float, Fault, str]] = []  # (time struck, fault, victim url)
        # Processes held by SIGSTOP: [name, stopped at, resumed at (None: not yet), planned].
        self.stops: list[list] = []
        self.counts = dict.fromkeys(("connects", "connect_retries", "skipped"), 0)

    # ------------------------------------------------------------------ processes
    def start_servers(self) -> None:
        def spawn(i: int):
            return spawn_expert_server(SPEC, HOSTED[i], f"chaos{self.plan.seed}s{i}")

        with ThreadPoolExecutor(len(HOSTED)) as pool:
            futures = [pool.submit(spawn, i) for i in range(len(HOSTED))]
            errors = []
            for i, f in enumerate(futures):
                try:  # every server that started is kept, so that the cleanup stops it
                    self.servers.append(ServerState(f"server {i}", f.result()))
                except Exception as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]

    def _spawn_standby(self, index: int) -> None:
        """Starts the next process of client `index`: it imports (seconds on this machine)
        while the current one runs, and starts when told, once the current one is gone."""
        gen = self.generation[index]
        self.generation[index] += 1
        job = ClientJob(
            self.plan.seed,
            CLIENT_IDS[index],
            gen,
            tuple(s.proc.url for s in self.servers),
            self.queue[index].pop(0),
            CLIENT_TIMEOUT_S,
            EVICT_S,
            THINK_S,
        )
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=client_main, args=(child, job), daemon=True)
        p.start()
        child.close()  # ours: the pipe reports EOF once the client is gone
        self.standby[index] = ClientProc(index, gen, job, p, parent)

    def _replace_clients(self) -> None:
        """Same id, new process: the standby of an id starts once its predecessor has closed
        its client (said "exit") or is gone; then the next standby of that id is spawned, once
        the running one has imported (several imports at once would starve the trial)."""
        for index in self.queue:
            current = self.running.get(index)
            if index in self.standby and (current is None or current.said_exit):
                if current is not None:  # finished once its process is gone
                    self.exiting.append(self.running.pop(index))
                cp = self.standby.pop(index)
                cp.conn.send(GO)
                self.running[index] = cp
            current = self.running.get(index)
            imported = current is None or current.said_ready
            if self.queue[index] and index not in self.standby and imported:
                self._spawn_standby(index)

    # ------------------------------------------------------------------ messages
    def _drain(self, cp: ClientProc) -> None:
        while cp.conn is not None and cp.conn.poll():
            try:
                msg = cp.conn.recv()
            except (EOFError, OSError):  # exited, or killed mid-message
                cp.conn.close()
                cp.conn = None
                return
            self._handle(cp, msg)

    def _handle(self, cp: ClientProc, msg: tuple) -> None:
        kind = msg[0]
        if kind == "done":
            _, key, timing, moved, evicted, y = msg
            cp.done.add(key)
            self.completions.append(Completion(timing.done, moved, tuple(evicted), cp.name, timing))
            # Checked once the trial is over (check_answers), not here: this loop strikes the
            # faults and ends the stops on time, and a reference forward pass per answer kept
            # it from doing so (0.05-2 s each on a loaded 2-core machine: a 0.8 s stop lasted
            # 4 s) while it took CPU from the clients that were re-routing.
            self.answers.append((cp.name, key, y))
        elif kind == "error":
            _, key, stage, reason = msg
            if key is not None:
                cp.failed.add(key)
            where = f"request {key[3:]}" if key is not None else "process"
            self.problems.append(f"{cp.name} {where}: {stage} failed: {reason[:MAX_REASON]}")
        elif kind == "connect":
            self.counts["connects"] += 1
            self.counts["connect_retries"] += msg[3] - 1
        elif kind == "exit":
            cp.said_exit = True
        elif kind == "ready":
            cp.said_ready = True
        else:
            self.problems.append(f"{cp.name}: unknown message {msg!r:.{MAX_REASON}}")

    def _finish(self, cp: ClientProc) -> None:
        """A client process is gone: read what it left in the pipe, account for its requests,
        and start the next process under the same id."""
        cp.process.join(JOIN_S)
        while cp.conn is not None:
            self._drain(cp)
            if cp.conn is not None and not cp.conn.poll(0.5):
                break  # should not happen: EOF follows a process's exit
        if self.running.get(cp.index) is cp:
            del self.running[cp.index]
        else:
            self.exiting.remove(cp)
        self.finished.append(cp)
        if not cp.killed:
            missing = cp.planned_keys() - cp.done - cp.failed
            if missing:
                self.problems.append(f"{cp.name}: {len(missing)} requests never completed")
            if cp.process.exitcode != 0 or not cp.said_exit:
                self.problems.append(f"{cp.name}: exit code {cp.process.exitcode}")

    # ------------------------------------------------------------------ faults
    def _strike(self, fault: Fault) -> bool:
        """Strikes `fault` if its victim is up; False to try again at the next tick (a client
        between two processes, or stopped). A fault on a client id with no process left is
        dropped and counted as skipped."""
        now = time.monotonic()
        if fault.target == "server":
            victim = self.servers[fault.index]
            pid, url = victim.proc.process.pid, victim.proc.url
        else:
            cp = self.running.get(fault.index)
            if cp is None and not self.queue[fault.index] and fault.index not in self.standby:
                self.counts["skipped"] += 1
                return True
            if cp is None or cp.stopped_until is not None or cp.killed or cp.said_exit:
                return False  # between processes, stopped, or done with its work
            victim, pid, url = cp, cp.process.pid, ""
        time.sleep(fault.jitter_s)
        struck = time.monotonic()
        if fault.action == "kill":
            os.kill(pid, signal.SIGKILL)
            victim.killed = True
            if fault.target == "client":
                self.queue[fault.index].append(
                    self.plan.replacement_runs(fault.index, self.generation[fault.index])
                )
        else:
            stop_process(pid)
            victim.stopped_until = now + fault.hold_s
            victim.stop_record = [victim.name, struck, None, fault.hold_s]
            self.stops.append(victim.stop_record)
        self.faults.append((struck, fault, url))
        return True

    def _resume_due(self, everything: bool = False) -> None:
        now = time.monotonic()
        # Exiting ones too: a client may say "exit" just before it is stopped.
        for v in [*self.servers, *self.running.values(), *self.exiting]:
            if v.stopped_until is not None and (everything or now >= v.stopped_until):
                pid = v.proc.process.pid if isinstance(v, ServerState) else v.process.pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                v.stopped_until = None
                if v.stop_record is not None:
                    v.stop_record[2] = time.monotonic()
                    v.stop_record = None

    # ------------------------------------------------------------------ the trial
    def run(self) -> None:
        deadline = time.monotonic() + TRIAL_DEADLINE_S
        self._replace_clients()
        while self.running or self.standby or self.exiting:
            if time.monotonic() > deadline:
                stuck = ", ".join(cp.name for cp in [*self.running.values(), *self.exiting])
                raise AssertionError(f"trial hung for {TRIAL_DEADLINE_S} s: {stuck} still running")
            procs = [*self.running.values(), *self.exiting, *self.standby.values()]
            conns = [cp.conn for cp in procs if cp.conn is not None]
            wait_any(conns + [cp.process.sentinel for cp in procs], POLL_S)
            for cp in [*self.running.values(), *self.exiting]:
                self._drain(cp)
                if not cp.process.is_alive():
                    self._finish(cp)
            for cp in list(self.standby.values()):
                self._drain(cp)
                if not cp.process.is_alive():
                    raise AssertionError(f"{cp.name} died before it started")
            self._replace_clients()
            done = len(self.completions)
            while self.pending and self.pending[0].at <= done and self._strike(self.pending[0]):
                self.pending.pop(0)
            self._resume_due()
        self.counts["skipped"] += len(self.pending)
        self._resume_due(everything=True)

    def check_answers(self) -> None:
        """Every answer a client reported, against the fault-free reference, bit for bit."""
        for name, key, y in self.answers:
            wrong = self.ref.mismatch(BatchKey(*key), y)
            if wrong is not None:
                self.problems.append(f"{name} request {key[3:]}: wrong result, {wrong}")

    def check(self) -> None:
        """Post-trial checks: surviving servers healthy and answering, then no leaked segment."""
        alive = [s for s in self.servers if not s.killed]
        for s in alive:
            problems, metrics = server_problems(s.name, s.proc.process, s.proc.url)
            self.problems += problems
            for k, v in metrics.items():
                self.counts[f"server_{k}"] = self.counts.get(f"server_{k}", 0) + v
        self.problems += probe_problems([s.proc.url for s in alive], PROBE_CLIENT_ID, self.ref)
        _stop_all(alive)
        for s in alive:
            if s.proc.process.exitcode != 0:
                self.problems.append(f"{s.name}: exit code {s.proc.process.exitcode} at stop")
        self.problems += segment_problems(*self._pids())

    def _pids(self) -> tuple[dict[int, str], dict[int, str]]:
        clean, dead = {}, {}
        for s in self.servers:
            clean_exit = not s.killed and s.proc.process.exitcode == 0
            (clean if clean_exit else dead)[s.proc.process.pid] = s.name
        for cp in self.finished:
            clean_exit = not cp.killed and cp.process.exitcode == 0
            (clean if clean_exit else dead)[cp.process.pid] = cp.name
        return clean, dead

    def cleanup(self) -> None:
        """Whatever happened: resume, kill and join every process of the trial, reap its
        segments. Idempotent."""
        self._resume_due(everything=True)
        for cp in [*self.running.values(), *self.exiting, *self.standby.values()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(cp.process.pid, signal.SIGKILL)
            cp.process.join(JOIN_S)
            if cp.conn is not None:
                cp.conn.close()
            self.unfinished.append(cp.process.pid)
        self.running.clear()
        self.exiting.clear()
        self.standby.clear()
        _stop_all(self.servers)
        clean, dead = self._pids()
        for pid in [*clean, *dead, *self.unfinished]:
            moecomm.reap_stale_segments(pid)

    # ------------------------------------------------------------------ figures
    def figures(self) -> dict:
        """Counts, and for each server fault the time from the fault to the first completed
        request that was re-routed around that server (measured by the clients)."""
        planned = survived = completed = 0
        for cp in self.finished:
            keys = cp.planned_keys()
            planned += len(keys)
            completed += len(cp.done)
            if not cp.killed:
                survived += len(keys)
        lost = sum(len(cp.planned_keys() - cp.done) for cp in self.finished if not cp.killed)
        reroute = {"kill": [], "stop": []}
        detail = []
        for t, fault, url in self.faults:
            if fault.target != "server":
                continue
            after = [c for c in self.completions if c.t > t and c.moved and url in c.evicted]
            if after:
                first = min(after, key=lambda c: c.t)
                reroute[fault.action].append((first.t - t) * 1e3)
                if fault.action == "kill":
                    detail.append(self._reroute_detail(t, url, first))
            elif fault.action == "kill":
                detail.append({"server": url, "ms": None})
        struck = [f for _, f, _ in self.faults]
        return {
            "requests": completed,
            "requests_planned": planned,
            "requests_of_surviving_clients": survived,
            "lost": lost,
            "abandoned_with_killed_clients": planned - completed - lost,
            "failovers": sum(c.moved for c in self.completions),
            **self.counts,
            "server_kills": sum(f.target == "server" and f.action == "kill" for f in struck),
            "server_stops": sum(f.target == "server" and f.action == "stop" for f in struck),
            "client_kills": sum(f.target == "client" and f.action == "kill" for f in struck),
            "client_stops": sum(f.target == "client" and f.action == "stop" for f in struck),
            "reroute_after_kill_ms": reroute["kill"],
            "reroute_after_stop_ms": reroute["stop"],
            "reroute_after_kill": detail,
            # How much longer than planned each SIGSTOP held its process: this loop ends the
            # stops, so a late loop shows here (and stretches every reroute behind a stop).
            "stop_overrun_ms": [
                round(((end - start) - hold) * 1e3, 1)
                for _, start, end, hold in self.stops
                if end is not None
            ],
        }

    def _reroute_detail(self, t: float, url: str, c: Completion) -> dict:
        """What the time from the kill at `t` to the first completion `c` re-routed around it
        is made of, in ms from the kill: when `c` was dispatched, when its combine evicted the
        dead server, how long its client waited for a CPU and how long it was held by SIGSTOP
        in that window."""
        frozen = sum(
            max(0.0, min(c.t, end if end is not None else c.t) - max(t, start))
            for name, start, end, _ in self.stops
            if name == c.client
        )
        ms = lambda v: round((v - t) * 1e3, 2)  # noqa: E731
        waited = c.timing.runqueue_s
        return {
            "server": url,
            "ms": ms(c.t),
            "client": c.client,
            "sent_ms": ms(c.timing.sent),
            "evicted_ms": ms(c.timing.evicted_at.get(url, c.t)),
            "runqueue_ms": None if waited is None else round(waited * 1e3, 2),
            "frozen_ms": round(frozen * 1e3, 2),
        }


def _stop_all(servers: list[ServerState]) -> None:
    """Graceful stop (SIGKILL after JOIN_S), all at once: each takes about a second."""
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        list(pool.map(lambda s: s.proc.stop(JOIN_S), servers))


@dataclass
class TrialResult:
    seed: int
    plan: str
    problems: list[str]
    figures: dict
    wall_s: float


def run_trial(
    seed: int, plan: TrialPlan, reference: Reference, trial_cls: type[Trial] = Trial
) -> TrialResult:
    """Runs the trial of `plan` and its checks; every process is gone when this returns,
    whether the trial passed, failed or was interrupted. `trial_cls`: a variant of Trial to
    compare with (bench/recovery/chaos_reroute.py)."""
    start = time.monotonic()
    trial = trial_cls(plan, reference)
    try:
        try:
            trial.start_servers()
            trial.run()
        except Exception as exc:  # a hang or a crash: report it with whatever else went wrong
            trial.problems.append(f"trial aborted: {type(exc).__name__}: {exc}")
        if len(trial.servers) == len(HOSTED):
            trial.check()
    finally:
        trial.cleanup()
    trial.check_answers()  # every process is gone: the reference has the CPU to itself
    return TrialResult(
        seed, plan.describe(), trial.problems, trial.figures(), time.monotonic() - start
    )
