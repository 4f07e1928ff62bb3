"""The engine's two halves of the prefill/decode split, in one process: a prefill engine ends a
request after its first token holding its KV blocks (HandoffEvent), the decode side reserves
blocks in its own pool (KvEndpoint.reserve, the metadata checked there), the prefill writes its
blocks into them through the real shm KV pools (moecomm.wire.kv), a second engine resumes from
the written blocks (EngineRequest.resume, its sequence adopts them), and the tokens equal one
engine running the request whole — greedy and seeded sampling, every family. A hand-off that
does not fit is refused with a clear error, at the reservation or in the engine, and the
engines go on with no block left behind."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from moecomm.wire.kv import KvTransferRequest
from moecomm_serving.disagg.schema import ReserveCall
from moecomm_serving.disagg.transfer import KvEndpoint, KvReservationError
from moecomm_serving.engine.scheduler import Engine, EngineRequest, run_to_completion
from moecomm_serving.model.tiny import write_tiny
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import (
    ErrorEvent,
    FinishEvent,
    HandoffEvent,
    Resume,
    SamplingParams,
    TokenEvent,
)

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
BLOCK = 8  # small blocks: the prompts span several and end inside one
LENGTHS = (3, 8, 21)
NEW_TOKENS = 6
TIMEOUT_S = 120.0
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(
    max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True
)
# Each engine's KV pool (the tiny models' blocks are a few KiB).
POOL_BYTES = 32 << 20


def prompt(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=ARCHS)
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"pd-{request.param}")
    write_tiny(str(path), request.param, seed=0)
    return load_model(path, dtype=torch.float32)


class Sink:
    """Collects one request's events; `done` is set by its last one."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if not isinstance(ev, TokenEvent):
            self.done.set()

    def wait(self):
        assert self.done.wait(TIMEOUT_S), "the engine did not answer"
        return self.events


def submit(engine, ids, params, **fields):
    sink = Sink()
    engine.submit(EngineRequest(list(ids), params, sink, float("inf"), **fields))
    return sink


def hand_off(prefill, decode, ev, handoff_id="h", package=None):
    """`ev`'s blocks written into blocks the decode side reserved (the reservation's call and
    answer through their JSON, as between two front ends); returns the decode side's blocks.
    The prefill's blocks are released, as its route does."""
    held = ev.package
    try:
        call = ReserveCall(handoff_id, package or held.package, prefill.kv.info)
        answer = decode.kv.reserve(ReserveCall.from_json(call.to_json()))
        slot, seq, _ = prefill.kv.write(answer, held)
    finally:
        held.release()
    req = KvTransferRequest.from_json(answer.request)
    assert (req.slot, req.seq) == (slot, seq)
    return decode.kv.take(handoff_id, slot, seq, TIMEOUT_S)


def split_run(prefill, decode, ids, params, handoff_id="h"):
    """The request's tokens through a prefill engine and a decode engine."""
    (ev,) = submit(prefill, ids, params, handoff=True).wait()
    assert isinstance(ev, HandoffEvent)
    assert ev.package.package.length == len(ids)
    got = hand_off(prefill, decode, ev, handoff_id)
    events = submit(decode, ids, params, resume=Resume(got, [ev.token], ev.rng_state)).wait()
    assert isinstance(events[-1], FinishEvent), events[-1]
    return [ev.token] + [e.token for e in events if isinstance(e, TokenEvent)]


@pytest.fixture()
def engines(family):
    pair = []
    try:
        for _ in range(2):
            engine = Engine(family, 64, kv_block_tokens=BLOCK)
            # the pool placed in shared memory before the engine serves, as a front end does
            engine.kv = KvEndpoint(engine.pool, POOL_BYTES)
            pair.append(engine.start())
        yield pair
        for e in pair:
            e.stop()
        for e in pair:
            assert e.pool.num_used == 0  # every block of every request given back
            assert e.kv.num_reserved == 0
    finally:
        for e in pair:
            e.stop()
            e.kv.close()


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_split_equals_one_engine(family, engines, params):
    prompts = [prompt(n, seed=n) for n in LENGTHS]
    whole = Engine(family, 64, kv_block_tokens=BLOCK).start()
    try:
        want = run_to_completion(whole, prompts, params, TIMEOUT_S)
    finally:
        whole.stop()
    got = [split_run(*engines, p, params) for p in prompts]
    assert got == want


def test_split_requests_share_steps(family, engines):
    """Several hand-offs in flight at once on both sides: same tokens as one at a time."""
    prompts = [prompt(n, seed=100 + n) for n in LENGTHS]
    alone = [split_run(*engines, p, GREEDY) for p in prompts]
    out: list = [None] * len(prompts)

    def one(i):
        out[i] = split_run(*engines, prompts[i], GREEDY, handoff_id=f"h{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert out == alone


def test_first_token_that_finishes_needs_no_handoff(family, engines):
    prefill, _ = engines
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    events = submit(prefill, prompt(5, seed=1), params, handoff=True).wait()
    assert [type(e) for e in events] == [TokenEvent, FinishEvent]
    assert events[0].finish == "length"


def handed(prefill, ids, params=GREEDY):
    (ev,) = submit(prefill, ids, params, handoff=True).wait()
    return ev


@pytest.mark.parametrize(
    "change, message",
    [
        ({"block_tokens": 4}, "block_tokens"),
        ({"version": 99}, "version"),
        ({"layers": (0,)}, "layers"),
        ({"kv_shape": (1, 2, 3)}, "kv_shape"),
        ({"dtype": "float16"}, "dtype"),
    ],
)
def test_metadata_that_does_not_fit_is_refused_at_the_reservation(family, engines, change, message):
    prefill, decode = engines
    ids = prompt(10, seed=2)
    ev = handed(prefill, ids)
    with pytest.raises(KvReservationError, match=message):
        hand_off(prefill, decode, ev, package=replace(ev.package.package, **change))
    assert decode.pool.num_used == 0 and decode.kv.num_reserved == 0  # nothing reserved
    assert split_run(prefill, decode, ids, GREEDY)[0] == ev.token  # both go on


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda ids, got, tok: ([*ids, 1], [tok], got), "holds"),  # prompt longer than KV
        (lambda ids, got, tok: (ids, [], got), "at least the prefill's first token"),
        (lambda ids, got, tok: (ids, [tok], "a package"), "HeldBlocks"),
    ],
    ids=["length", "no-token", "not-blocks"],
)
def test_a_handoff_that_does_not_fit_is_refused_by_the_engine(family, engines, bad, message):
    prefill, decode = engines
    ids = prompt(10, seed=2)
    ev = handed(prefill, ids)
    got = hand_off(prefill, decode, ev)
    p, tokens, package = bad(ids, got, ev.token)
    (err,) = submit(decode, p, GREEDY, resume=Resume(package, tokens)).wait()
    assert isinstance(err, ErrorEvent) and err.status == 400 and message in err.message
    got.release()  # what the decode route does when the engine did not adopt them
    # the engine goes on: a good hand-off right after is served
    assert split_run(prefill, decode, ids, GREEDY)[0] == ev.token
    assert decode.pool.num_used == 0


def test_blocks_of_another_pool_or_taken_twice_are_refused(family, engines):
    prefill, decode = engines
    ids = prompt(9, seed=4)
    ev = handed(prefill, ids)
    (err,) = submit(decode, ids, GREEDY, resume=Resume(ev.package, [ev.token])).wait()
    assert isinstance(err, ErrorEvent) and "another KV pool" in err.message
    got = hand_off(prefill, decode, ev)  # releases the prefill's blocks
    events = submit(decode, ids, GREEDY, resume=Resume(got, [ev.token])).wait()
    assert isinstance(events[-1], FinishEvent)
    (err,) = submit(decode, ids, GREEDY, resume=Resume(got, [ev.token])).wait()
    assert isinstance(err, ErrorEvent) and "taken already" in err.message


def test_sampled_handoff_needs_its_sampler_state(family, engines):
    prefill, decode = engines
    ids = prompt(6, seed=3)
    ev = handed(prefill, ids, SAMPLED)
    assert ev.rng_state is not None
    got = hand_off(prefill, decode, ev)
    try:
        (err,) = submit(decode, ids, SAMPLED, resume=Resume(got, [ev.token], None)).wait()
        assert isinstance(err, ErrorEvent) and "sampler state" in err.message
        junk = torch.zeros(7, dtype=torch.uint8)
        (err,) = submit(decode, ids, SAMPLED, resume=Resume(got, [ev.token], junk)).wait()
        assert isinstance(err, ErrorEvent) and "sampler state" in err.message
    finally:
        got.release()
