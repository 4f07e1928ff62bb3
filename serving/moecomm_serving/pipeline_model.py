"""A :class:`moecomm.pipeline.driver.Pipeline` behind the interface the serving engine drives
(``config``, ``experts``, ``new_sequence``, ``forward``), so the OpenAI front end serves a model
split into pipeline stages (``moecomm frontend --stages N``).

Each engine step is one micro-batch through every stage; the last stage returns the logits of
each sequence's last row and the engine samples with each request's own parameters, exactly as
over the monolithic model. The stages' own profiles feed the DynaPipe predictor, and the
bubble-aware scheduler moves layers (and their KV caches) between stages while serving.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Sequence

import torch
from moecomm.pipeline.driver import REFIT_EVERY, WARMUP_RESULTS, Pipeline, feed_profiles
from moecomm.pipeline.predictor import LatencyPredictor
from moecomm.pipeline.scheduler import BubbleScheduler

from moecomm_serving.config import MoEConfig


class StageSequence:
    """A sequence's handle on the engine side: its id and its length. The caches live in the
    stage processes; when the engine drops the handle, the stages are told to free them."""

    def __init__(self, seq_id: int, owner: PipelinedModel):
        self.seq_id = seq_id
        self.length = 0
        weakref.finalize(self, owner._release, seq_id)


class PipelinedModel:
    """The model as the engine sees it, computed by `pipe` (built with ``return_logits=True``).

    Only the engine thread calls :meth:`forward`; `dynapipe` turns on layer redistribution
    (predictor fitted from the stages' profiles, scheduler with its stability window).
    """

    def __init__(self, pipe: Pipeline, config: MoEConfig, dynapipe: bool = True):
        self.pipe, self.config = pipe, config
        self.experts = None  # the stages hold their own experts backends
        # The per-chunk and per-request context terms the formula lacks (docs/pipeline.md: held-
        # out error 2-3% with them against 8-11% without); the stages profile one regime per
        # step, so there are no cold samples to fit a cold term from.
        self.predictor = LatencyPredictor(chunk_term=True, context_term=True) if dynapipe else None
        self.scheduler = BubbleScheduler(pipe.num_layers, pipe.num_stages) if dynapipe else None
        self._ids = itertools.count()
        self._freed: list[int] = []  # appended by finalizers (any thread), drained by forward
        self._lock = threading.Lock()
        self._results = 0

    def new_sequence(self) -> StageSequence:
        return StageSequence(next(self._ids), self)

    def _release(self, seq_id: int) -> None:
        with self._lock:
            self._freed.append(seq_id)

    def forward(
        self, token_ids: Sequence[Sequence[int]], caches: Sequence[StageSequence]
    ) -> torch.Tensor:
        """Appends ``token_ids[j]`` to sequence j; ``[B, vocab]`` float32 logits of each
        sequence's last new token."""
        with self._lock:
            freed, self._freed = self._freed, []
        if freed:
            self.pipe.free(freed)
        feeds = [[int(t) for t in torch.as_tensor(f).reshape(-1)] for f in token_ids]
        ids = [c.seq_id for c in caches]
        past = [c.length for c in caches]
        num_new = [len(f) for f in feeds]
        self._schedule(num_new, [p + n for p, n in zip(past, num_new, strict=True)])
        self.pipe.submit(ids, past, num_new, [t for f in feeds for t in f])
        _, logits = self.pipe.result()
        for c, n in zip(caches, num_new, strict=True):
            c.length += n
        self._learn()
        return torch.from_numpy(logits)

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

    def close(self) -> None:
        self.pipe.close()
