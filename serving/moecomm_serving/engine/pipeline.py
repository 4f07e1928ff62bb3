"""A :class:`moecomm.pipeline.driver.Pipeline` behind the interface the serving engine drives
(``config``, ``experts``, ``new_sequence``, ``forward``), so the OpenAI front end serves a model
split into pipeline stages (``moecomm frontend --stages N``).

Each engine step is one micro-batch through every stage; the last stage returns the logits of
each sequence's last row and the engine samples with each request's own parameters, exactly as
over the monolithic model. The stages' own profiles feed the DynaPipe predictor, and the
bubble-aware scheduler moves layers (and their KV caches) between stages while serving.

Supervision: a stage that dies, fails or stays stopped makes the step raise
:class:`~moecomm.pipeline.driver.PipelineError`; with a `restart` factory the model replaces the
whole pipeline (by the standby pipeline it keeps started in the background, or a new one),
feeds every live sequence's tokens again (the front end keeps them: re-prefill rebuilds every
stage's KV) and re-runs the step, so the engine sees a slow step, not a failed one. Sampling
happens in the engine after a step returns, so a re-run step draws nothing twice.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from moecomm.pipeline.driver import (
    REFIT_EVERY,
    STAGE_START_TIMEOUT_S,
    WARMUP_RESULTS,
    Pipeline,
    PipelineError,
    feed_profiles,
)
from moecomm.pipeline.predictor import LatencyPredictor
from moecomm.pipeline.scheduler import BubbleScheduler

from moecomm_serving.model.config import MoEConfig

# How long close() gives every stage of every pipeline (serving, standby, retired) to exit,
# all at once, before the ones left are killed: a stage's exit (its expert client's goodbye,
# torch's teardown) takes about a second, several on a loaded 2-core host; a supervisor that
# stops the front end waits 20-30 s for the whole process.
CLOSE_DEADLINE_S = 8.0
# Replacements one engine step may take before its requests fail: a stage that dies again and
# again on the same step (a crash its input causes, expert servers gone for good) is not fixed
# by new processes, and each replacement without a standby costs a pipeline start-up.
MAX_RESTARTS_PER_STEP = 2


def split_even(num_new: Sequence[int], parts: int) -> list[range]:
    """Cuts a batch into at most `parts` contiguous, non-empty runs of sequences with about
    equal token counts: the micro-batches of one engine step."""
    parts = max(1, min(parts, len(num_new)))
    total, out, start, acc = sum(num_new), [], 0, 0
    for j, n in enumerate(num_new[:-1]):
        acc += n
        need = parts - len(out) - 1  # runs still to start after this cut
        if need > 0 and (acc * parts >= total * (len(out) + 1) or len(num_new) - j - 1 == need):
            out.append(range(start, j + 1))
            start = j + 1
    out.append(range(start, len(num_new)))
    return out


class StageSequence:
    """A sequence's handle on the engine side: its id and its length. The caches live in the
    stage processes; when the engine drops the handle, the stages are told to free them."""

    def __init__(self, seq_id: int, owner: PipelinedModel):
        self.seq_id = seq_id
        self.length = 0
        weakref.finalize(self, owner._release, seq_id)


@dataclass(frozen=True)
class Recovery:
    """One replacement of the stages."""

    reason: str  # the PipelineError that caused it
    stage: int | None  # the stage to blame, when one is
    standby: bool  # the standby pipeline took over (else a new one was started)
    start_s: float  # the failed pipeline closed and the new one ready
    reprefill_s: float  # every live sequence's tokens fed again
    sequences: int
    tokens: int

    @property
    def seconds(self) -> float:
        return self.start_s + self.reprefill_s


class PipelinedModel:
    """The model as the engine sees it, computed by `pipe` (built with ``return_logits=True``).

    Only the engine thread calls :meth:`forward`; `dynapipe` turns on layer redistribution
    (predictor fitted from the stages' profiles, scheduler with its stability window).
    `restart(initial_k)` builds a pipeline like `pipe` (with that layer map); with it, a lost
    stage is replaced and the step re-run (without it, the step's requests fail). `standby`
    keeps one more pipeline started (in a background thread) for the next replacement: it
    doubles the stages' memory and saves their start-up on the critical path. `say` gets one
    line per replacement. `micro_batches` (at most the pipeline's slots per boundary) cuts
    each engine step into that many micro-batches, all in flight at once, so stage b computes
    one while stage b+1 computes the one before (1: the step as one micro-batch).
    """

    def __init__(
        self,
        pipe: Pipeline,
        config: MoEConfig,
        dynapipe: bool = True,
        restart: Callable[[int], Pipeline] | None = None,
        standby: bool = False,
        say: Callable[[str], None] | None = None,
        micro_batches: int = 1,
    ):
        if standby and restart is None:
            raise ValueError("a standby pipeline needs the restart factory")
        if not 1 <= micro_batches <= pipe.num_slots:
            raise ValueError(
                f"micro_batches must be in [1, {pipe.num_slots}] (the slots per stage boundary), "
                f"got {micro_batches}"
            )
        self.micro_batches = micro_batches
        self.pipe, self.config = pipe, config
        self.experts = None  # the stages hold their own experts backends
        # The per-chunk and per-request context terms the formula lacks (docs/pipeline.md: held-
        # out error 2-3% with them against 8-11% without); the stages profile one regime per
        # step, so there are no cold samples to fit a cold term from.
        self.predictor = LatencyPredictor(chunk_term=True, context_term=True) if dynapipe else None
        self.scheduler = BubbleScheduler(pipe.num_layers, pipe.num_stages) if dynapipe else None
        self._ids = itertools.count()
        self._freed: list[int] = []  # appended by finalizers (any thread), drained by forward
        # Every token each live sequence's caches hold: what a replacement feeds again.
        self._history: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self._results = 0
        self._restart, self._say = restart, say or (lambda line: None)
        self.recoveries: list[Recovery] = []
        self._standby_on, self._standby = standby, None
        self._standby_thread: threading.Thread | None = None
        self._retired: list[Pipeline] = []  # failed pipelines whose stages may still be exiting
        # Set by close() (under the lock): no replacement or standby starts after it, and a
        # standby that finishes starting closes itself.
        self._closing = False
        if standby:
            self._start_standby()

    def new_sequence(self) -> StageSequence:
        seq = StageSequence(next(self._ids), self)
        with self._lock:
            self._history[seq.seq_id] = []
        return seq

    def _release(self, seq_id: int) -> None:
        with self._lock:
            self._history.pop(seq_id, None)
            self._freed.append(seq_id)

    def forward(
        self, token_ids: Sequence[Sequence[int]], caches: Sequence[StageSequence]
    ) -> torch.Tensor:
        """Appends ``token_ids[j]`` to sequence j; ``[B, vocab]`` float32 logits of each
        sequence's last new token."""
        feeds = [[int(t) for t in torch.as_tensor(f).reshape(-1)] for f in token_ids]
        ids = [c.seq_id for c in caches]
        past = [c.length for c in caches]
        num_new = [len(f) for f in feeds]
        lost: PipelineError | None = None
        failures = 0
        while True:
            try:
                if lost is not None:
                    self._replace(lost)
                    lost = None
                logits = self._step(ids, past, num_new, [t for f in feeds for t in f])
                break
            except PipelineError as exc:
                failures += 1
                # a pipeline closed by close() is not lost: nothing replaces it
                if self._restart is None or failures > MAX_RESTARTS_PER_STEP or self._closing:
                    raise
                lost = exc
        with self._lock:
            for c, f in zip(caches, feeds, strict=True):
                c.length += len(f)
                history = self._history.get(c.seq_id)
                if history is not None:
                    history.extend(f)
        self._learn()
        return torch.from_numpy(logits)

    def _step(self, ids: list[int], past: list[int], num_new: list[int], tokens: list[int]):
        with self._lock:
            freed, self._freed = self._freed, []
        if freed:
            self.pipe.free(freed)
        lengths = [p + n for p, n in zip(past, num_new, strict=True)]
        offsets = list(itertools.accumulate(num_new, initial=0))
        parts = split_even(num_new, self.micro_batches)
        for r in parts:  # all in flight before the first result: the stages overlap them
            a, b = r.start, r.stop
            self._schedule(num_new[a:b], lengths[a:b])
            self.pipe.submit(ids[a:b], past[a:b], num_new[a:b], tokens[offsets[a] : offsets[b]])
        out = [self.pipe.result()[1] for _ in parts]  # in submission order
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _schedule(self, num_new: list[int], lengths: list[int]) -> None:
        if self.scheduler is None or not self.predictor.ready:
            return
        decision = self.scheduler.observe(*self.predictor.predict(num_new, lengths, len(num_new)))
        if decision.changed:
            self.pipe.remap(decision.ranges, decision.applied)

    def _learn(self) -> None:
        profiles = self.pipe.drain_profiles()  # drained either way: they would pile up
        if self.predictor is None:
            return
        feed_profiles(self.predictor, profiles)
        self._results += 1
        r = self._results
        if r >= WARMUP_RESULTS and (not self.predictor.ready or r % REFIT_EVERY == 0):
            with contextlib.suppress(ValueError):  # too few samples yet
                self.predictor.fit()

    # ------------------------------------------------------------------ supervision
    def _replace(self, exc: PipelineError) -> None:
        """Replaces every stage and rebuilds the live sequences' caches in the new ones."""
        if self._closing:  # close() stopped the stages: nothing to replace
            raise exc
        t0 = time.monotonic()
        self._say(f"pipeline stage lost ({exc}); replacing the stages")
        old = self.pipe  # failed, so closed: its stages are being reaped in the background
        self._retired.append(old)
        pipe = self._take_standby()
        standby = pipe is not None
        if pipe is None:
            old.close()  # waits until its stages are gone: a new pipeline may reuse their ids
            pipe = self._restart(old.k if isinstance(old.k, int) else 0)
        self.pipe = pipe
        if self._closing:  # close() came while these stages started: they stop too
            pipe.close(grace_s=CLOSE_DEADLINE_S)
            raise exc
        if self.scheduler is not None:  # it starts over from the map the new stages run
            self.scheduler.k = pipe.k
            self.scheduler.recent.clear()
        t1 = time.monotonic()
        sequences, tokens = self._reprefill()
        rec = Recovery(
            str(exc), exc.stage, standby, t1 - t0, time.monotonic() - t1, sequences, tokens
        )
        self.recoveries.append(rec)
        self._say(
            f"pipeline restarted in {rec.seconds:.3f} s (stages {rec.start_s:.3f} s, re-prefill "
            f"{rec.reprefill_s:.3f} s; {sequences} sequences, {tokens} tokens; "
            f"{'standby' if standby else 'new'} stages)"
        )
        self._say(f"pipeline stage pids: {' '.join(map(str, pipe.pids))}")
        if self._standby_on and not self._closing:
            self._start_standby()

    def recovery_counts(self) -> dict[str, int]:
        """Replacements so far by kind, for /metrics: "standby" (the standby stages took over)
        and "new" (new stages were started). Any thread: it reads a copy of the list."""
        done = list(self.recoveries)
        standby = sum(r.standby for r in done)
        return {"standby": standby, "new": len(done) - standby}

    def _reprefill(self) -> tuple[int, int]:
        """Feeds every live sequence's tokens to the new stages (as many per micro-batch as its
        slots hold, a long sequence over several); returns (sequences, tokens)."""
        with self._lock:
            live = [(sid, list(h)) for sid, h in self._history.items() if h]
        done = dict.fromkeys((sid for sid, _ in live), 0)
        cap = self.pipe.layout.max_tokens
        while any(done[sid] < len(h) for sid, h in live):
            ids, past, num_new, tokens, room = [], [], [], [], cap
            for sid, h in live:
                n = min(len(h) - done[sid], room)
                if n > 0:
                    ids.append(sid)
                    past.append(done[sid])
                    num_new.append(n)
                    tokens += h[done[sid] : done[sid] + n]
                    done[sid] += n
                    room -= n
            self.pipe.submit(ids, past, num_new, tokens)
            self.pipe.result()
        self.pipe.drain_profiles()  # prefill-only steps of a recovery: not the serving mix
        return len(live), sum(len(h) for _, h in live)

    def _start_standby(self) -> None:
        retired, self._retired = self._retired, []

        def build() -> None:
            for p in retired:  # gone before a new pipeline may reuse their client ids
                p.close()
            try:
                pipe = self._restart(0)
            except Exception as exc:  # the next replacement starts a new pipeline itself
                self._say(f"pipeline: the standby stages did not start: {exc}")
                return
            with self._lock:
                closing = self._closing
                if not closing:
                    self._standby = pipe
            if closing:  # close() did not wait for these stages: they stop here
                pipe.close(grace_s=CLOSE_DEADLINE_S)
                return
            self._say(f"pipeline standby stages ready: pids {' '.join(map(str, pipe.pids))}")

        self._standby_thread = threading.Thread(
            target=build, name="moecomm-standby-stages", daemon=True
        )
        self._standby_thread.start()

    def _take_standby(self) -> Pipeline | None:
        """The standby pipeline if it is (or soon will be) ready and all its stages live."""
        if self._standby_thread is None:
            return None
        # One still starting is ready sooner than a new one would be.
        self._standby_thread.join(STAGE_START_TIMEOUT_S)
        self._standby_thread = None
        with self._lock:
            pipe, self._standby = self._standby, None
        if pipe is None:
            return None
        try:
            pipe.check()
        except PipelineError as exc:  # it died while waiting (check closed it)
            self._say(f"pipeline: the standby stages are lost too ({exc})")
            return None
        return pipe

    def close(self) -> None:
        """Stops every stage within :data:`CLOSE_DEADLINE_S`: all pipelines (serving, standby,
        retired) are told to stop first, then each is waited for with what is left of the one
        deadline (the ones left are killed). A standby still starting is not waited for: it
        closes itself once started (or, should this process exit first, multiprocessing's
        exit handler ends its daemon processes). A step in flight fails; nothing replaces it."""
        deadline = time.monotonic() + CLOSE_DEADLINE_S
        with self._lock:
            self._closing = True
            standby, self._standby = self._standby, None
        pipes = [p for p in (standby, *self._retired, self.pipe) if p is not None]
        self._retired = []
        for p in pipes:
            p.ask_stop()
        for p in pipes:
            p.close(grace_s=max(0.0, deadline - time.monotonic()))
        if self._standby_thread is not None:
            self._standby_thread.join(max(0.0, deadline - time.monotonic()))
