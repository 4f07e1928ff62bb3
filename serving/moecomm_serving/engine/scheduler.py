"""Continuous batching: one engine thread runs every request in flight through the model.

The engine repeatedly (1) drops cancelled and expired requests, (2) admits waiting requests in
arrival order while the step's token budget and sequence limit allow, and (3) runs one forward
over the active :class:`Generation` s (what :func:`~moecomm_serving.engine.generate.step` does, plus
chunked prefill): a new request's prompt (prefill) is packed into the same forward as the
single decode token of every request already running, split over several steps when it does
not fit the token budget; a finished request leaves after the step that produced its last
token.

Requests talk to the engine through events handed to their ``emit`` callback *on the engine
thread*: :class:`TokenEvent` per token, then exactly one :class:`FinishEvent` or
:class:`ErrorEvent`. A step that raises fails every request of that step (they shared the
forward, so none of them has a trustworthy next token) with an :class:`ErrorEvent`; the engine
keeps serving the others. A failed request is never retried: its stream has already shown
tokens, and a sampled continuation would not be reproducible.

KV cache. By default every request's cache is paged (:mod:`moecomm_serving.kv.blocks`, one
block pool per engine) and its blocks are freed the moment the request leaves, whatever the
reason (finished, failed, cancelled, expired). With a prefix cache
(:mod:`moecomm_serving.kv.prefix_cache`), a new request starts from the cached blocks of its
prompt's longest cached prefix and prefills only the rest; a request's full blocks enter the
cache once its prompt is prefilled (so requests running meanwhile share them) and again when it
finishes (prompt and answer: the next turn of a chat).

Prefill/decode split (docs/router.md): a request with ``handoff`` ends after its prompt's first
token with a :class:`HandoffEvent` carrying its KV blocks (exported before they are freed); a
request with ``resume`` starts from such a package, imported into this engine's pool when it is
admitted (the pool is the engine thread's alone), and decodes on as if it had run here whole.

Only the engine thread touches the model, so an experts backend that is not thread-safe (an
:class:`moecomm.runtime.AttentionClient`) is safe behind it; the health probe is a request too.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from moecomm.errors import DeadlineExceededError, MoecommError

from moecomm_serving.engine.generate import Generation
from moecomm_serving.kv.blocks import DEFAULT_BLOCK_TOKENS
from moecomm_serving.kv.prefix_cache import PrefixCache
from moecomm_serving.model.transformer import MoETransformer
from moecomm_serving.types import (
    ErrorEvent,
    Event,
    FinishEvent,
    HandoffEvent,
    Resume,
    SamplingParams,
    TokenEvent,
)

# How long the idle engine sleeps on its condition before re-checking stop and deadlines.
IDLE_POLL_S = 0.05
# Bounds the waiting queue so overload answers 503 at once instead of timing out later.
DEFAULT_MAX_QUEUE = 1024
# The prefill a prefix-cache hit skips is valued at the marginal cost of one more token in a
# forward: the slope of step seconds against step tokens, fitted over recent steps (a step's
# fixed cost, which a hit does not save, is the intercept). Each step's weight in the fit decays
# by this factor per later step: ~100 steps of memory, enough to hold a few prefills among the
# decodes, short enough to follow a change of load.
STEP_COST_DECAY = 0.99
# Below this variance of step sizes (relative to their mean square) there is no slope to fit.
MIN_TOKEN_SPREAD = 1e-3


class EngineBusyError(MoecommError, RuntimeError):
    """The waiting queue is full, or the engine is stopped (HTTP 503)."""


@dataclass
class EngineRequest:
    """One request as the engine sees it. ``emit`` is called on the engine thread."""

    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    deadline: float  # time.monotonic() after which the request fails with 504
    arrival: float = field(default_factory=time.monotonic)
    request_id: int = 0
    cancelled: bool = False  # set by any thread (client gone, stop string seen)
    generation: Generation | None = None
    prefilled: int = 0  # prompt tokens already in the cache (chunked prefill)
    done: bool = False
    # Prefill only: after the prompt's first token the request ends with a HandoffEvent
    # carrying its KV cache (a prefill front end of the prefill/decode split).
    handoff: bool = False
    # Decode side: starts from a handed-over KV cache instead of its prompt.
    resume: Resume | None = None

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class EngineStats:
    """Counters a test or /metrics can read; written only by the engine thread."""

    steps: int = 0
    max_batch_size: int = 0  # most sequences seen in one step
    batched_steps: int = 0  # steps with more than one sequence
    mixed_steps: int = 0  # steps packing a prefill with another request's decode
    step_failures: int = 0
    prefill_chunks: int = 0  # partial prompt chunks (prompts split across steps)
    tokens: int = 0
    finished: int = 0
    failed: int = 0
    busy_s: float = 0.0


class Engine:
    """The continuous-batching loop over one model.

    Args:
        model: the whole model (embedding to LM head), with its experts backend.
        max_batch_tokens: most tokens one forward may carry (prompt chunks + one per decode).
            With an AttentionClient this must not exceed its ``max_tokens``. A longer prompt is
            prefilled in chunks over several steps.
        max_num_seqs: most sequences running at once (capped at `max_batch_tokens`, so every
            running request's decode token always fits a step).
        max_queue: most requests waiting for admission; beyond it :meth:`submit` raises.
        batch_wait_s: when the engine is idle and a request arrives, wait this long for others
            before the first step, so a burst shares its prefill forward (0: start at once).
        eos_token_id: end-of-sequence id, or every id that ends a sequence (the model config's by
            default).
        kv_block_tokens: tokens per block of the paged KV cache (None: one growable buffer per
            sequence and layer, the old cache). A model without ``new_block_pool`` (a pipeline,
            whose stages keep the caches) always uses its own.
        prefix_cache_bytes: byte budget of the prefix cache (0: none); needs the paged cache.
    """

    def __init__(
        self,
        model: MoETransformer,
        max_batch_tokens: int,
        max_num_seqs: int = 64,
        max_queue: int = DEFAULT_MAX_QUEUE,
        batch_wait_s: float = 0.0,
        eos_token_id: int | Sequence[int] | None = None,
        kv_block_tokens: int | None = DEFAULT_BLOCK_TOKENS,
        prefix_cache_bytes: int = 0,
    ):
        if max_batch_tokens < 1 or max_num_seqs < 1 or max_queue < 1:
            raise ValueError(
                f"max_batch_tokens, max_num_seqs and max_queue must be >= 1, got "
                f"{max_batch_tokens}, {max_num_seqs}, {max_queue}"
            )
        self.model = model
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = min(max_num_seqs, max_batch_tokens)
        self.max_queue = max_queue
        self.batch_wait_s = batch_wait_s
        self.eos_token_id = eos_token_id
        self.stats = EngineStats()
        new_pool = getattr(model, "new_block_pool", None)
        if prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {prefix_cache_bytes}")
        if prefix_cache_bytes and (kv_block_tokens is None or new_pool is None):
            raise ValueError("a prefix cache needs the paged KV cache (kv_block_tokens)")
        self.pool = new_pool(kv_block_tokens) if new_pool and kv_block_tokens else None
        self.prefix_cache = (
            PrefixCache(self.pool, prefix_cache_bytes) if prefix_cache_bytes else None
        )
        # decayed sums of 1, x, y, x*x, x*y over steps (x: tokens, y: seconds), see _note_step
        self._fit = [0.0] * 5
        self._waiting: deque[EngineRequest] = deque()
        self._active: list[EngineRequest] = []
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="moecomm-engine", daemon=True)
        self.error: BaseException | None = None  # set if the loop itself dies

    # ------------------------------------------------------------------ life cycle
    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the loop; requests still waiting or running fail with 503."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    # ------------------------------------------------------------------ submit
    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._active)

    def submit(self, req: EngineRequest, priority: bool = False) -> EngineRequest:
        """Queues `req` (at the head with `priority`: the health probe must not wait behind
        a long queue to learn whether a forward works)."""
        with self._cond:
            if self._stop or not self._thread.is_alive():
                raise EngineBusyError("the engine is not running")
            if len(self._waiting) >= self.max_queue:
                raise EngineBusyError(f"{len(self._waiting)} requests already waiting (max_queue)")
            req.request_id = next(self._ids)
            if priority:
                self._waiting.appendleft(req)
            else:
                self._waiting.append(req)
            self._cond.notify_all()
        return req

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stop:
                        break
                    if not self._active and not self._waiting:
                        self._cond.wait(IDLE_POLL_S)
                        continue
                    if not self._active and self.batch_wait_s > 0:
                        self._gather_burst()
                self._expire()
                self._admit()
                if self._active:
                    self._step()
        except BaseException as exc:  # the loop must not die silently: fail everyone
            self.error = exc
            self._fail_all(f"engine loop crashed: {exc!r}", 500)
            raise
        self._fail_all("the engine stopped", 503)

    def _gather_burst(self) -> None:
        """Called with the lock held and nothing active: wait out the batching window."""
        deadline = time.monotonic() + self.batch_wait_s
        while not self._stop and len(self._waiting) < self.max_num_seqs:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)

    def _finish(self, req: EngineRequest, event: Event) -> None:
        req.done = True
        req.resume = None
        if req.generation is not None:
            req.generation.release()
        if isinstance(event, ErrorEvent):
            self.stats.failed += 1
        else:
            self.stats.finished += 1
        req.emit(event)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
            for req in waiting:
                if req.cancelled:
                    req.done = True
                elif now > req.deadline:
                    self._finish(req, ErrorEvent("deadline exceeded while queued", 504, now))
                else:
                    self._waiting.append(req)
        expired = [r for r in self._active if not r.cancelled and now > r.deadline]
        for req in self._active:
            req.done = req.done or req.cancelled
            if req.cancelled:
                req.generation.release()
        # leave the batch before the error goes out, so whoever reads it sees a consistent engine
        self._active = [r for r in self._active if not r.done and r not in expired]
        for req in expired:
            self._finish(req, ErrorEvent("deadline exceeded while generating", 504, now))

    def _admit(self) -> None:
        """FIFO admission while this step still has token budget: every running request
        needs one decode token or the rest of its prompt; a newcomer is admitted only if at
        least one of its prompt tokens fits, so the head of the queue is never starved."""
        budget = self.max_batch_tokens - sum(_need(r) for r in self._active)
        with self._cond:
            while self._waiting and len(self._active) < self.max_num_seqs and budget > 0:
                req = self._waiting.popleft()
                try:
                    req.generation = self._generation(req)
                except Exception as exc:  # a bad request must not take the engine down
                    self._finish(req, ErrorEvent(str(exc), 400, time.monotonic()))
                    continue
                # a prefix-cache hit: those prompt tokens are in the cache already
                req.prefilled = req.generation.cached
                self._note_hit(req.generation.cached)
                budget -= len(req.prompt) - req.prefilled
                self._active.append(req)

    def _generation(self, req: EngineRequest) -> Generation:
        r = req.resume
        if r is None:
            return Generation(
                self.model, req.prompt, req.params, self.eos_token_id, self.pool, self.prefix_cache
            )
        # The pool is the engine thread's alone: a handed-over cache is imported here.
        g = Generation.resume(
            self.model,
            req.prompt,
            req.params,
            self.eos_token_id,
            self.pool,
            r.package,
            r.tokens,
            r.rng_state,
        )
        req.resume = None  # the package's tensors are in the pool now: let them go
        return g

    def _plan(self) -> list[tuple[EngineRequest, list[int]]]:
        """What each request feeds this step: decodes first (one token each, always fit since
        ``max_num_seqs <= max_batch_tokens``), then prompt chunks in admission order. A
        prefilling request that gets no budget sits this step out."""
        budget = self.max_batch_tokens
        plan = []
        for req in self._active:
            if req.generation.tokens:
                plan.append((req, req.generation.tokens[-1:]))
                budget -= 1
        for req in self._active:
            if not req.generation.tokens and budget > 0:
                chunk = req.prompt[req.prefilled : req.prefilled + budget]
                plan.append((req, chunk))
                budget -= len(chunk)
        return plan

    def _step(self) -> None:
        plan = self._plan()
        batch = [req for req, _ in plan]
        t0 = time.monotonic()
        try:
            logits = self.model.forward([f for _, f in plan], [r.generation.cache for r in batch])
        except Exception as exc:
            # The model rolled these caches back; the requests still fail (no silent retry).
            # Requests that sat this step out are unaffected.
            now = time.monotonic()
            self.stats.step_failures += 1
            self._active = [r for r in self._active if r not in batch]
            for req in batch:
                req.generation.release()
                if not req.cancelled:
                    self._finish(req, ErrorEvent(f"forward step failed: {exc}", 500, now))
            return
        now = time.monotonic()
        out: list[tuple[EngineRequest, int]] = []
        prefills = chunks = 0
        for row, (req, feed) in enumerate(plan):
            if not req.generation.tokens:
                prefills += 1
                chunks += len(feed) < len(req.prompt) - req.generation.cached
                req.prefilled += len(feed)
                if req.prefilled < len(req.prompt):
                    continue  # a prompt chunk: no token until the whole prompt is in
                req.generation.remember()  # the whole prompt is cached: share it from now on
            out.append((req, req.generation.accept(logits[row])))
        self._note_step(now - t0, sum(len(f) for _, f in plan))
        s = self.stats
        s.steps += 1
        s.busy_s += now - t0
        s.tokens += len(out)
        s.max_batch_size = max(s.max_batch_size, len(batch))
        s.batched_steps += len(batch) > 1
        s.mixed_steps += 0 < prefills < len(batch)
        s.prefill_chunks += chunks
        handed: dict[int, HandoffEvent] = {}
        for req, tok in out:
            g = req.generation
            if req.handoff and not req.cancelled and not g.finished:
                # exported before the release below frees the blocks
                handed[id(req)] = HandoffEvent(
                    tok, g.cache.export_blocks(), g.sampler_state(), g.cached, now
                )
        for req in batch:
            req.done = req.cancelled or req.generation.finished or id(req) in handed
            if req.generation.finished and not req.cancelled:
                req.generation.remember()  # prompt and answer: a next chat turn starts here
            if req.done:
                req.generation.release()
        # finished requests leave the batch before their events go out (consistent counters)
        self._active = [r for r in self._active if not r.done]
        for req, tok in out:
            if req.cancelled:
                continue
            if id(req) in handed:
                self._finish(req, handed[id(req)])
                continue
            req.emit(TokenEvent(tok, now, req.generation.finish_reason))
            if req.generation.finished:
                self._finish(req, FinishEvent(req.generation.finish_reason, now))

    def _note_step(self, seconds: float, tokens: int) -> None:
        """Adds one step to the decayed least-squares fit of seconds against tokens."""
        if self.prefix_cache is None:
            return
        f = self._fit
        for k, value in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
            f[k] = STEP_COST_DECAY * f[k] + value

    def seconds_per_token(self) -> float | None:
        """Marginal forward seconds per token: the fit's slope, or, while every step seen had
        about the same size (no slope to fit), the mean cost per token (an upper bound)."""
        n, sx, sy, sxx, sxy = self._fit
        if not sx:
            return None
        spread = n * sxx - sx * sx
        if spread > MIN_TOKEN_SPREAD * n * sxx:
            return max(0.0, (n * sxy - sx * sy) / spread)
        return sy / sx

    def _note_hit(self, tokens: int) -> None:
        """Credits a prefix-cache hit with the prefill time it skips (estimated)."""
        rate = self.seconds_per_token() if tokens else None
        if rate is not None:
            self.prefix_cache.stats.saved_prefill_s += tokens * rate

    def _fail_all(self, message: str, status: int) -> None:
        now = time.monotonic()
        with self._cond:
            pending = [*self._active, *self._waiting]
            self._active, self._waiting = [], deque()
        for req in pending:
            if not req.done:
                self._finish(req, ErrorEvent(message, status, now))


def _need(req: EngineRequest) -> int:
    """Tokens a running request still wants in the next step."""
    return 1 if req.generation.tokens else len(req.prompt) - req.prefilled


def run_to_completion(
    engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams, timeout: float
) -> list[list[int]]:
    """Submits `prompts` and blocks until all finish (a helper for tests and scripts)."""
    done = threading.Event()
    results: list[list[int]] = [[] for _ in prompts]
    errors: list[str] = []
    left = [len(prompts)]
    lock = threading.Lock()

    def sink(i):
        def emit(ev: Event) -> None:
            if isinstance(ev, TokenEvent):
                results[i].append(ev.token)
                return
            if isinstance(ev, ErrorEvent):
                errors.append(ev.message)
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        return emit

    deadline = time.monotonic() + timeout
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(list(p), params, sink(i), deadline))
    if not done.wait(timeout):
        raise DeadlineExceededError(
            f"{left[0]} of {len(prompts)} requests unfinished after {timeout} s"
        )
    if errors:
        raise RuntimeError(f"requests failed: {errors}")
    return results
