"""The client processes of bench/soak/soak.py: inputs, the in-process reference, the round-trip
loop.

Each client is an AttentionClient with two micro-batches in flight. It reports its counters per
interval to the parent over a queue at least every FLUSH_S; see soak.py for what is checked.
"""

from __future__ import annotations

import faulthandler
import os
import time
import traceback
from collections import deque

import torch
from moecomm.runtime.experts import LayerExperts
from moecomm.runtime.launch import ModelSpec
from moecomm.testing import connect_client

# Micro-batches a client keeps in flight: double-batch overlap, one per slot.
IN_FLIGHT = 2
# Clients send their counters at least this often, so the parent sees progress (and a stall).
FLUSH_S = 1.0
# Granularity of the waits that must also watch a clock or a flag (the parent's queue reads,
# a client waiting for the start).
POLL_S = 0.2
# Spawning 8 clients imports torch 8 times at once: on a 2-core machine that alone takes ~20 s.
START_TIMEOUT_S = 180.0
# A client keeps its first few error and wrong-result reports; the counts are always complete.
MAX_SAMPLES = 5
# A client that has failed this many round trips stops: the run has failed by then anyway.
MAX_CLIENT_ERRORS = 100
# Share of (token, k) pairs routed to no expert (-1), a legal input that takes its own path.
NO_EXPERT_FRACTION = 0.05
# Client idx of run seed s draws from seed s * SEED_STRIDE + idx: distinct for every (s, idx).
SEED_STRIDE = 1_000_003
# What a client counts per interval besides its latencies: round trips, those of them with 0
# tokens, requests to servers, results checked and wrong, errors, failovers, reconnects.
COUNTS = ("rt", "empty", "requests", "checked", "wrong", "errors", "failovers", "reconnects")


class Reference:
    """What the servers must have answered for a dispatch, computed in-process with the same
    weights and the runtime's summation order: per server the sum over its experts (its own
    LayerExperts, so its own order), then the servers' partials added in the handle's order."""

    def __init__(self, spec: ModelSpec, hosted: list[dict[int, list[int]]]):
        experts = spec.experts()
        self.hidden = spec.hidden
        self.servers = []
        for h in hosted:
            per_layer = {}
            for layer, ids in h.items():
                le = LayerExperts(layer, {e: experts[layer][e] for e in ids})
                local = torch.full((spec.num_experts,), -1, dtype=torch.int64)
                local[torch.tensor(le.logical_ids)] = torch.arange(le.num_local)
                per_layer[layer] = (le, local)
            self.servers.append(per_layer)

    def expected(self, handle, x, ids, w) -> tuple[torch.Tensor | None, str]:
        """(expected output, "") or (None, why the dispatch itself was wrong)."""
        y = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32)
        covered = torch.zeros(ids.shape, dtype=torch.int32)
        for s in handle.sent:
            le, local = self.servers[s.server][handle.layer_id]
            rows = s.token_index
            covered[rows] += s.pairs.int()
            lid = torch.where(s.pairs, local[ids[rows].clamp(min=0).long()], -1)
            if bool((lid[s.pairs] < 0).any()):
                return None, f"server {s.server} got an expert it does not host"
            scores = torch.where(s.pairs, w[rows], 0.0)
            (part,) = le.forward([x[rows]], [lid.int()], [scores])
            y[rows] += part.float()
        if not torch.equal(covered, (ids >= 0).int()):
            return None, "a (token, k) pair was sent to no server or to two"
        return y, ""


def make_batch(g: torch.Generator, cfg, step: int):
    n = int(torch.randint(0, cfg.max_tokens + 1, (1,), generator=g))
    x = torch.randn(n, cfg.hidden, generator=g)
    ids = torch.rand(n, cfg.num_experts, generator=g).argsort(dim=1)[:, : cfg.topk].int()
    ids[torch.rand(n, cfg.topk, generator=g) < NO_EXPERT_FRACTION] = -1
    w = torch.rand(n, cfg.topk, generator=g)
    return x, ids, w, step % cfg.num_layers


class Counters:
    """Per-interval counters of one client, sent to the parent and cleared at each flush."""

    def __init__(self):
        self.buckets: dict[int, dict] = {}
        self.errors: list[str] = []
        self.wrong: list[dict] = []

    def bucket(self, b: int) -> dict:
        if b not in self.buckets:
            self.buckets[b] = {"lat_ns": [], **dict.fromkeys(COUNTS, 0)}
        return self.buckets[b]

    def take(self) -> tuple:
        out = (self.buckets, self.errors, self.wrong)
        self.buckets, self.errors, self.wrong = {}, [], []
        return out


def _client_loop(idx, cfg, c, ref, t0_ns, stop, q) -> None:
    quota = cfg.round_trips // cfg.clients + (idx < cfg.round_trips % cfg.clients)
    g = torch.Generator().manual_seed(cfg.seed * SEED_STRIDE + idx)
    interval_ns = int(cfg.interval_s * 1e9)
    acc, pending = Counters(), deque()
    started = finished = nerr = 0
    failovers, reconnects = c.failovers, c.reconnects
    last_flush = time.monotonic()

    def fail(bucket: int, step: int, exc: BaseException) -> None:
        nonlocal nerr
        nerr += 1
        acc.bucket(bucket)["errors"] += 1
        if len(acc.errors) < MAX_SAMPLES:
            acc.errors.append(f"client {idx} step {step}: {type(exc).__name__}: {exc}")

    while finished < quota and nerr < MAX_CLIENT_ERRORS:
        while len(pending) < IN_FLIGHT and started < quota and not stop.is_set():
            x, ids, w, layer = make_batch(g, cfg, started)
            t = time.monotonic_ns()
            try:
                pending.append((c.dispatch(x, ids, w, layer), (x, ids, w), t, started))
            except Exception as exc:
                fail((t - t0_ns) // interval_ns, started, exc)
                finished += 1
            started += 1
        if not pending:
            break
        pick = -1 if cfg.order == "random" and int(torch.randint(2, (1,), generator=g)) else 0
        h, (x, ids, w), t, step = pending[pick]
        del pending[pick]
        b = (t - t0_ns) // interval_ns
        finished += 1
        try:
            y = c.combine(h)
        except Exception as exc:
            fail(b, step, exc)
            continue
        lat = time.monotonic_ns() - t
        k = acc.bucket(b)
        k["rt"] += 1
        k["requests"] += len(h.sent)
        if x.shape[0]:
            k["lat_ns"].append(lat)
        else:
            k["empty"] += 1
        if step % cfg.check_every == 0:
            k["checked"] += 1
            want, why = ref.expected(h, x, ids, w)
            if want is None or not torch.equal(y, want):
                k["wrong"] += 1
                if len(acc.wrong) < MAX_SAMPLES:
                    diff = None if want is None else float((y - want).abs().max())
                    where = dict(client=idx, step=step, layer=h.layer_id, tokens=int(x.shape[0]))
                    acc.wrong.append({**where, "max_abs_diff": diff, "why": why or "differs"})
        k["failovers"] += c.failovers - failovers
        k["reconnects"] += c.reconnects - reconnects
        failovers, reconnects = c.failovers, c.reconnects
        if time.monotonic() - last_flush >= FLUSH_S:
            q.put(("stats", idx, *acc.take()))
            last_flush = time.monotonic()
            # A client stuck in one wait stops flushing: after stall_s its stack goes to stderr.
            faulthandler.dump_traceback_later(cfg.stall_limit_s(), exit=False)
    q.put(("stats", idx, *acc.take()))
    q.put(("end", idx, None))  # from here on this client winds down: RSS no longer steady


def client_main(idx, cfg, urls, t0, go, stop, q) -> None:
    torch.set_num_threads(1)  # the clients share the cores with each other and the servers
    faulthandler.dump_traceback_later(START_TIMEOUT_S + cfg.stall_limit_s(), exit=False)
    c = None
    try:
        # a random id (client_id None): unique without coordination
        c = connect_client(
            urls, cfg.hidden, cfg.topk, cfg.max_tokens, num_slots=IN_FLIGHT, timeout=cfg.timeout_s
        )
        ref = Reference(cfg.spec(), c.hosted)
        q.put(("ready", idx, os.getpid()))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not go.wait(POLL_S):
            if stop.is_set() or time.monotonic() > deadline:
                return
        _client_loop(idx, cfg, c, ref, t0.value, stop, q)
    except BaseException:
        q.put(("fatal", idx, traceback.format_exc()))
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        try:
            if c is not None:
                c.close()
        finally:
            q.put(("done", idx, None))
