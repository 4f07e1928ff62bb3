"""The driver side of a stage pipeline: spawns the stage processes, connects their slot channels,
feeds micro-batches, collects results and profiles, and changes the layer map on the fly.

:class:`Pipeline` is the mechanism (submit / result / remap / free); :func:`run_decode` is a
decode loop over it with micro-batch groups, the latency predictor and the bubble-aware
scheduler (DynaPipe).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from moecomm import prefork
from moecomm.errors import MoecommError
from moecomm.pipeline.predictor import LatencyPredictor
from moecomm.pipeline.remote import RemoteStage, start_remote
from moecomm.pipeline.scheduler import BubbleScheduler, stage_ranges
from moecomm.pipeline.stage import PEER_LOST_PREFIX, STEP_TIMEOUT_S, StageSpec, stage_main
from moecomm.wire.protocol import SlotLayout
from moecomm.wire.shm import reap_stale_segments
from moecomm.wire.stage import stage_layout

# Loading a stage's weights in a fresh interpreter (torch import included) on a busy machine.
STAGE_START_TIMEOUT_S = 120.0
# How often the driver checks its stages' liveness while it waits for a result.
LIVENESS_POLL_S = 0.05
# A stage the kernel reports stopped (SIGSTOP, a debugger) this long is declared lost and killed:
# a serving stage never stops itself, and a stopped one holds up every micro-batch behind it. A
# slow stage still runs, so this can be far below the step deadline (which a loaded 2-core host
# needs); one second lets a stop/continue pair of a checkpointing tool pass.
STOPPED_DEADLINE_S = 1.0
# How long the stages of a failed pipeline get to stop (and close their expert clients) before
# they are killed; nobody waits for it but close(): a survivor next to a dead stage notices within
# its inbox slice (0.5 s), one waiting on a live but blocked neighbour would wait for its deadline.
FAILED_STOP_GRACE_S = 1.0
# A stage that reports a lost peer is a witness, not the culprit: the driver looks this long for
# a stage that died (its exit or closed connection arrives within milliseconds of the peer's
# report) and blames that one, so the error names the stage or host that was lost.
PEER_LOST_BLAME_S = 1.0
# Refit the predictor every this many results: a fit costs ~1 ms, a step several.
REFIT_EVERY = 32
# Results profiled before the first fit: the first steps are prefills and cold caches, and a
# fit on a handful of them would steer the scheduler with noise.
WARMUP_RESULTS = 16


class PipelineError(MoecommError):
    """A stage failed or died; the message names the stage and what happened (``stage``: its
    index, when one stage is to blame)."""

    stage: int | None = None
    detail: str = ""


def _stopped(pid: int) -> bool:
    """Whether the kernel reports `pid` stopped (state T: SIGSTOP; t: stopped by a tracer)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False  # gone already: the exit code says so


def _preload(num_layers: int, num_stages: int, k_max: int, index: int) -> range:
    """Every layer stage `index` owns for some k <= k_max (one contiguous range)."""
    rs = [stage_ranges(num_layers, num_stages, k)[index] for k in range(k_max + 1)]
    return range(min(r.start for r in rs), max(r.stop for r in rs))


class Pipeline:
    """S stage processes joined by slot channels.

    Args:
        factory: picklable ``(index, preload, owned) -> StageCompute``, called in each child.
        num_layers, num_stages: pipeline shape.
        layout: the activation slot layout (``hidden``, ``max_tokens`` per micro-batch and
            the encoding of the hidden states); every stage channel is sized from it.
        k_max: most layers the scheduler may move off the last stage; stages preload the
            weights of every layer they can receive up to that.
        initial_k: the layer map at start (0: uniform).
        num_slots: micro-batches in flight per stage boundary.
        stage_hosts: where each stage runs: None (or an entry None / "local") spawns it here;
            ``HOST:PORT`` starts it under the stage agent there (``moecomm.pipeline.agent``).
        transport: what the stages offer each other (``moecomm.wire.choose``): "shm", "nixl" or
            "auto" (shm between stages on one host, nixl across); default "auto" when a stage
            runs elsewhere, else "shm".
        host: the address the local stages carry nixl over (None: any interface).
        stage_token: the token the stage agents check (needed with remote stages).
    """

    def __init__(
        self,
        factory: Callable,
        num_layers: int,
        num_stages: int,
        layout: SlotLayout,
        k_max: int = 0,
        initial_k: int = 0,
        num_slots: int = 2,
        timeout_s: float = STEP_TIMEOUT_S,
        stage_hosts: Sequence[str | None] | None = None,
        transport: str | None = None,
        host: str | None = None,
        stage_token: bytes | str = b"",
    ):
        places = [None if h in (None, "", "local") else h for h in (stage_hosts or [])]
        if stage_hosts is not None and len(places) != num_stages:
            raise ValueError(
                f"stage_hosts names {len(places)} places for {num_stages} stages (one per stage; "
                "'local' for this host)"
            )
        self.stage_hosts = places or [None] * num_stages
        remote = any(self.stage_hosts)
        if isinstance(stage_token, str):
            stage_token = stage_token.encode()
        if remote and not stage_token:
            raise ValueError("stages on other hosts need the stage agents' token (stage_token)")
        self.transport = transport or ("auto" if remote else "shm")
        # (i, j) -> the transport stages i and j speak, once connected
        self.transports: dict[tuple[int, int], str] = {}
        self.num_layers, self.num_stages = num_layers, num_stages
        self.num_slots, self.timeout_s = num_slots, timeout_s
        self.layout = stage_layout(layout.max_tokens, layout.hidden, layout.encoding)
        self.ranges = tuple(stage_ranges(num_layers, num_stages, initial_k))
        self.k = initial_k  # layers moved off the last stage in the current map
        stage_ranges(num_layers, num_stages, k_max)  # validates k_max
        if not 0 <= initial_k <= k_max:
            raise ValueError(f"initial_k must be in [0, k_max = {k_max}], got {initial_k}")
        self.preloads = [_preload(num_layers, num_stages, k_max, i) for i in range(num_stages)]
        ctx = prefork.process_context()  # "spawn", or the preloaded fork server in tests
        self.procs, self.conns = [], []
        self.next_step = 0
        self.inflight: deque[int] = deque()
        self.profiles: list[tuple] = []  # (stage, step, num_new, lengths, layer_times[, t_sample])
        self.closed = False
        self._stopped_since: dict[int, float] = {}  # stage -> when it was first seen stopped
        self._closer: threading.Thread | None = None  # reaps the stages of a failed pipeline
        try:
            for i in range(num_stages):
                parent, child = ctx.Pipe()
                spec = StageSpec(
                    i,
                    num_stages,
                    self.ranges,
                    self.preloads[i],
                    self.layout.to_dict(),
                    num_slots,
                    factory,
                    timeout_s,
                    self.transport,
                    host,
                )
                if self.stage_hosts[i] is not None:
                    parent.close()
                    child.close()
                    try:
                        stage = start_remote(self.stage_hosts[i], stage_token, spec)
                    except ConnectionError as exc:
                        # A PipelineError, so a supervisor that replaces lost stages retries
                        # (bounded) and then reports it, as for a stage that died.
                        err = PipelineError(f"stage {i}: {exc}")
                        err.stage = i
                        raise err from None
                    self.procs.append(stage)
                    self.conns.append(stage.conn)
                    continue
                p = ctx.Process(target=stage_main, args=(spec, child), daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self._connect()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ set-up / tear-down
    def _connect(self) -> None:
        # hello = (_, offer, pid, host name): what each stage offers its peers
        hellos = [self._expect(i, "hello", STAGE_START_TIMEOUT_S) for i in range(self.num_stages)]
        for p, hello in zip(self.procs, hellos, strict=True):
            if isinstance(p, RemoteStage):
                p.pid = hello[2]
        offers = [h[1] for h in hellos]
        for conn in self.conns:
            conn.send(("offers", offers))
        # ready = (_, {transport: doorbell}, {(kind, src): receiver handle},
        #          {(kind, dst): sender handle}, {peer: transport})
        ready = [self._expect(i, "ready", STAGE_START_TIMEOUT_S) for i in range(self.num_stages)]
        for i in range(self.num_stages):
            for j, name in ready[i][4].items():
                if ready[j][4].get(i) != name:
                    raise PipelineError(
                        f"stages {i} and {j} disagree on their transport: stage {i} picked "
                        f"{name}, stage {j} picked {ready[j][4].get(i)} (one can read the "
                        "other's shared memory, not the reverse?)"
                    )
                self.transports[(i, j)] = name
        for i, conn in enumerate(self.conns):
            choice = ready[i][4]
            to_receivers = {
                (kind, dst): (ready[dst][2][(kind, i)], ready[dst][1][choice[dst]])
                for kind, dst in ready[i][3]
            }
            to_senders = {(kind, src): ready[src][3][(kind, i)] for kind, src in ready[i][2]}
            conn.send(("connect", to_receivers, to_senders))
        for i in range(self.num_stages):
            self._expect(i, "connected", STAGE_START_TIMEOUT_S)

    def _expect(self, i: int, kind: str, timeout: float):
        deadline = time.monotonic() + timeout
        while not self.conns[i].poll(LIVENESS_POLL_S):
            self._check_alive()
            if time.monotonic() > deadline:
                raise PipelineError(f"stage {i} sent no {kind!r} within {timeout} s")
        msg = self._recv(i)
        if msg[0] != kind:
            raise PipelineError(f"stage {i}: expected {kind!r}, got {msg[0]!r}")
        return msg

    def _recv(self, i: int):
        try:
            msg = self.conns[i].recv()
        except (EOFError, OSError):
            self._check_alive(wait=True)
            raise PipelineError(f"stage {i} closed its control pipe") from None
        if msg[0] == "error":
            if msg[2].startswith(PEER_LOST_PREFIX):
                self._blame_the_dead()
            self._fail(f"stage {msg[1]} failed: {msg[2].strip().splitlines()[-1]}", msg[2], msg[1])
        return msg

    def _blame_the_dead(self) -> None:
        """A stage lost a peer: if a stage died, that one is the failure to report (raises);
        its death may reach us a moment after its peer's report, hence the short wait."""
        deadline = time.monotonic() + PEER_LOST_BLAME_S
        while True:
            self._check_alive()
            if time.monotonic() >= deadline:
                return
            time.sleep(LIVENESS_POLL_S)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _check_alive(self, wait: bool = False) -> None:
        if wait:  # a closed pipe: give the exit code a moment to be reaped
            for p in self.procs:
                p.join(LIVENESS_POLL_S)
        dead = [
            (i, p)
            for i, p in enumerate(self.procs)
            if (p.poll_gone() if isinstance(p, RemoteStage) else p.exitcode is not None)
        ]
        if dead:
            for i, _ in dead:  # a stage that failed (rather than died) said why: report that
                with contextlib.suppress(EOFError, OSError):
                    while self.conns[i].poll(0):
                        msg = self.conns[i].recv()
                        if msg[0] == "error":
                            self._fail(
                                f"stage {msg[1]} failed: {msg[2].strip().splitlines()[-1]}",
                                msg[2],
                                msg[1],
                            )
            what = ", ".join(
                f"stage {i} {p.describe()} closed its control connection (it exited or its host "
                "is gone)"
                if isinstance(p, RemoteStage)
                else f"stage {i} (pid {p.pid}) exited with code {p.exitcode}"
                + (f" (signal {-p.exitcode})" if p.exitcode < 0 else "")
                for i, p in dead
            )
            self._fail(f"pipeline stage lost: {what}; {self._steps()}", stage=dead[0][0])
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            # A remote stage's process state is not visible here: its step deadline covers it.
            if isinstance(p, RemoteStage) or not _stopped(p.pid):
                self._stopped_since.pop(i, None)
                continue
            since = self._stopped_since.setdefault(i, now)
            if now - since > STOPPED_DEADLINE_S:
                # Killed, not left stopped: it must never wake up and act on a stale step. Reaped
                # here, so it is gone (not a zombie) once the failure is raised.
                os.kill(p.pid, signal.SIGKILL)
                p.join(STOPPED_DEADLINE_S)
                self._fail(
                    f"pipeline stage lost: stage {i} (pid {p.pid}) stopped for more than "
                    f"{STOPPED_DEADLINE_S} s; {self._steps()}",
                    stage=i,
                )

    def _steps(self) -> str:
        return f"steps {list(self.inflight)} in flight" if self.inflight else "idle"

    def _fail(self, message: str, detail: str = "", stage: int | None = None) -> None:
        self._abandon()
        err = PipelineError(message)
        err.detail, err.stage = detail, stage
        raise err

    def check(self) -> None:
        """Raises PipelineError (and closes the pipeline) if a stage died or is stopped."""
        if self.closed:
            raise PipelineError("the pipeline is closed")
        self._check_alive()

    def _abandon(self) -> None:
        """Closes a failed pipeline without waiting for its stages to exit: they are asked to
        stop, and a thread kills whichever is left after FAILED_STOP_GRACE_S and reaps their
        segments. A replacement shares nothing with them, so it need not wait (a survivor's exit,
        torch's teardown included, takes about a second on a loaded host); :meth:`close` waits."""
        if self.closed:
            return
        self.closed = True
        self._ask_stop()
        self._closer = threading.Thread(
            target=self._reap, args=(FAILED_STOP_GRACE_S,), name="moecomm-stage-reaper", daemon=True
        )
        self._closer.start()

    def close(self, grace_s: float | None = None) -> None:
        """Stops every stage (asks, then kills after `grace_s`, by default a quarter of the step
        deadline) and reaps their segments; after a failure, waits until that is done."""
        if self.closed:
            if self._closer is not None:
                self._closer.join()
            return
        self.closed = True
        self._ask_stop()
        self._reap(self.timeout_s / 4 if grace_s is None else grace_s)

    def ask_stop(self) -> None:
        """Tells every stage to stop without waiting for it (:meth:`close` waits): whoever
        stops several pipelines asks them all first, so their stages exit at once."""
        if not self.closed:
            self._ask_stop()

    def _ask_stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(("stop",))

    def _reap(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if isinstance(p, RemoteStage):
                p.kill()  # its end of the connection closes: it exits (nothing to reap here)
            elif p.is_alive():
                p.kill()  # a forked one may be reaped already
                p.join(self.timeout_s / 4)
        for p in self.procs:
            if not isinstance(p, RemoteStage):
                reap_stale_segments(p.pid)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ commands
    def _broadcast(self, msg) -> None:
        if self.closed:
            raise PipelineError("the pipeline is closed")
        for i, conn in enumerate(self.conns):
            try:
                conn.send(msg)
            except (BrokenPipeError, OSError):
                self._check_alive(wait=True)
                self._fail(f"stage {i} closed its control pipe")

    def submit(
        self,
        seq_ids: Sequence[int],
        past: Sequence[int],
        num_new: Sequence[int],
        tokens: Sequence[int],
    ) -> int:
        """Queues one micro-batch; returns its step number. Results come back in step order."""
        if not (len(seq_ids) == len(past) == len(num_new)) or sum(num_new) != len(tokens):
            raise ValueError(
                f"micro-batch: {len(seq_ids)} ids, {len(past)} lengths, {len(num_new)} counts "
                f"and {len(tokens)} tokens (expected sum(num_new) = {sum(num_new)})"
            )
        if len(tokens) > self.layout.max_tokens:
            raise ValueError(
                f"micro-batch of {len(tokens)} tokens exceeds the slot's max_tokens "
                f"{self.layout.max_tokens}"
            )
        step = self.next_step
        self._broadcast(("step", step, list(seq_ids), list(past), list(num_new), list(tokens)))
        self.next_step += 1
        self.inflight.append(step)
        return step

    def remap(self, ranges: Sequence[range], k: int | None = None) -> int:
        """Switches to a new layer map from the step after the next one submitted, so the
        sources know during that next step which layers to send; returns the first step
        that runs under `ranges`."""
        ranges = tuple(ranges)
        if len(ranges) != self.num_stages or any(len(r) == 0 for r in ranges):
            raise ValueError(f"layer map {ranges}: need one non-empty range per stage")
        if [i for r in ranges for i in r] != list(range(self.num_layers)):
            raise ValueError(f"layer map {ranges} is not a contiguous cover of the layers")
        for i, (r, pre) in enumerate(zip(ranges, self.preloads, strict=True)):
            if r.start < pre.start or r.stop > pre.stop:
                raise ValueError(
                    f"layer map gives stage {i} layers {r.start}..{r.stop - 1}, but it preloaded "
                    f"only {pre.start}..{pre.stop - 1} (raise k_max)"
                )
        effective = self.next_step + 1
        self._broadcast(("remap", effective, ranges))
        self.ranges, self.k = ranges, k
        return effective

    def free(self, seq_ids: Sequence[int]) -> None:
        self._broadcast(("free", list(seq_ids)))

    def result(self) -> tuple[int, list[int]]:
        """Waits for the oldest micro-batch in flight: ``(step, tokens)``."""
        if not self.inflight:
            raise RuntimeError("no micro-batch in flight")
        last = self.num_stages - 1
        deadline = time.monotonic() + self.timeout_s
        while True:
            for i in range(last):
                while self.conns[i].poll(0):
                    _, step, prof = self._recv(i)
                    self.profiles.append((i, step, *prof))
            if self.conns[last].poll(LIVENESS_POLL_S):
                msg = self._recv(last)
                _, step, out, prof = msg
                want = self.inflight.popleft()
                if step != want:
                    self._fail(f"result of step {step} arrived while {want} was expected")
                self.profiles.append((last, step, *prof))
                return step, out
            self._check_alive()
            if time.monotonic() > deadline:
                self._fail(
                    f"no result for step {self.inflight[0]} within {self.timeout_s} s "
                    f"(all stages alive: a stage is stuck)"
                )

    def drain_profiles(self) -> list[tuple]:
        out, self.profiles = self.profiles, []
        return out


@dataclass
class DecodeRun:
    """Outcome of :func:`run_decode`."""

    tokens: list[list[int]]
    step_ks: list[int] = field(default_factory=list)  # k in force at each step run
    remaps: list[tuple[int, int]] = field(default_factory=list)  # (effective step, k)
    seconds: float = 0.0
    steps: int = 0


def feed_profiles(predictor: LatencyPredictor, profiles: list[tuple]) -> None:
    """Adds the layer and sampling times the stages profiled to `predictor`."""
    for prof in profiles:
        _, _, num_new, lengths, layer_times, *rest = prof
        for t in layer_times:
            predictor.add_layer(num_new, lengths, t)
        if rest:
            predictor.add_sample(len(num_new), rest[0])


def run_decode(
    pipe: Pipeline,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    groups: int | None = None,
    scheduler: BubbleScheduler | None = None,
    predictor: LatencyPredictor | None = None,
    forced: dict[int, int] | None = None,
    stop_ids: Sequence[int] = (),
) -> DecodeRun:
    """Decodes `prompts` through `pipe` (the last stage picks each token: greedy or seeded
    sampling, as its compute does), with `groups` micro-batches in flight.

    Sequences are split round-robin into groups; a group's next step is submitted when its
    previous one returns. With `scheduler` (and `predictor`, fed from the stages' own
    profiles), the layer map follows the scheduler's decisions; `forced` maps a submission
    index to a k to switch to (tests drive redistribution deterministically with it).
    """
    groups = groups or pipe.num_slots
    members = [list(range(g, len(prompts), groups)) for g in range(groups)]
    members = [m for m in members if m]
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    run = DecodeRun(out)
    k = k0 = pipe.k
    if scheduler is not None:
        scheduler.k = k  # the scheduler starts from the map the pipeline runs
    owner: dict[int, int] = {}  # step -> group

    def submit(g: int) -> None:
        nonlocal k
        ids = [j for j in members[g] if not done[j]]
        if not ids:
            return
        if forced and run.steps in forced and forced[run.steps] != k:
            k = forced[run.steps]
            if scheduler is not None:  # the scheduler starts over from the forced map
                scheduler.k = k
                scheduler.recent.clear()
            ranges = stage_ranges(pipe.num_layers, pipe.num_stages, k)
            run.remaps.append((pipe.remap(ranges, k), k))
        elif scheduler is not None and predictor is not None and predictor.ready:
            nn = [1 if out[j] else len(prompts[j]) for j in ids]
            lens = [len(prompts[j]) + len(out[j]) for j in ids]
            decision = scheduler.observe(*predictor.predict(nn, lens, len(ids)))
            if decision.changed:
                k = decision.applied
                run.remaps.append((pipe.remap(decision.ranges, k), k))
        past = [len(prompts[j]) + len(out[j]) - 1 if out[j] else 0 for j in ids]
        feed = [list(prompts[j]) if not out[j] else out[j][-1:] for j in ids]
        step = pipe.submit(ids, past, [len(f) for f in feed], [t for f in feed for t in f])
        owner[step] = g
        run.steps += 1

    t0, results = time.perf_counter(), 0
    for g in range(len(members)):
        submit(g)
    while pipe.inflight:
        step, tokens = pipe.result()
        g = owner.pop(step)
        ids = [j for j in members[g] if not done[j]]
        finished = []
        for j, tok in zip(ids, tokens, strict=True):
            out[j].append(tok)
            if len(out[j]) >= max_new_tokens or tok in stop_ids:
                done[j] = True
                finished.append(j)
        if finished:
            pipe.free(finished)
        profiles = pipe.drain_profiles()  # drained either way: they would pile up
        if predictor is not None:
            feed_profiles(predictor, profiles)
            results += 1
            if results >= WARMUP_RESULTS and (not predictor.ready or results % REFIT_EVERY == 0):
                with contextlib.suppress(ValueError):  # too few samples yet
                    predictor.fit()
        submit(g)
    run.seconds = time.perf_counter() - t0
    changes, k = dict(run.remaps), k0  # effective step -> k
    for s in range(pipe.next_step - run.steps, pipe.next_step):
        k = changes.get(s, k)
        run.step_ks.append(k)
    return run
