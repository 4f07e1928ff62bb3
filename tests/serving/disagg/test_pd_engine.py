"""The engine's two halves of the prefill/decode split, in one process: a prefill engine ends a
request after its first token with its KV package (HandoffEvent), a second engine resumes it
from that package (EngineRequest.resume), and the tokens equal one engine running the request
whole — greedy and seeded sampling, every family, the package through the wire format of
kv_handoff; a hand-off that does not fit is refused with a clear error and the engine goes on."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from moecomm_serving.engine.scheduler import Engine, EngineRequest, run_to_completion
from moecomm_serving.kv.package import decode_package, encode_package
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


def split_run(prefill, decode, ids, params, handoff_id="h"):
    """The request's tokens through a prefill engine and a decode engine."""
    (ev,) = submit(prefill, ids, params, handoff=True).wait()
    assert isinstance(ev, HandoffEvent)
    assert ev.package.length == len(ids)
    # through the wire format, as a decode front end receives it
    package = decode_package(encode_package(ev.package, handoff_id), handoff_id)
    events = submit(decode, ids, params, resume=Resume(package, [ev.token], ev.rng_state)).wait()
    assert isinstance(events[-1], FinishEvent), events[-1]
    return [ev.token] + [e.token for e in events if isinstance(e, TokenEvent)]


@pytest.fixture()
def engines(family):
    pair = [Engine(family, 64, kv_block_tokens=BLOCK).start() for _ in range(2)]
    yield pair
    for e in pair:
        e.stop()
    for e in pair:
        assert e.pool.num_used == 0  # every block of every request given back


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
    "bad, message",
    [
        (lambda ev, ids: ([*ids, 1], [ev.token], ev.package), "holds"),  # prompt longer than KV
        (lambda ev, ids: (ids, [], ev.package), "at least the prefill's first token"),
        (lambda ev, ids: (ids, [ev.token], replace(ev.package, block_tokens=4)), "block_tokens"),
        (lambda ev, ids: (ids, [ev.token], replace(ev.package, k=ev.package.k[:, :1])), "shape"),
        (lambda ev, ids: (ids, [ev.token], replace(ev.package, version=99)), "version"),
    ],
    ids=["length", "no-token", "block-size", "truncated-k", "version"],
)
def test_a_handoff_that_does_not_fit_is_refused(family, engines, bad, message):
    prefill, decode = engines
    ids = prompt(10, seed=2)
    ev = handed(prefill, ids)
    p, tokens, package = bad(ev, ids)
    (err,) = submit(decode, p, GREEDY, resume=Resume(package, tokens)).wait()
    assert isinstance(err, ErrorEvent) and err.status == 400 and message in err.message
    # the engine goes on: a good hand-off right after is served
    assert split_run(prefill, decode, ids, GREEDY)[0] == ev.token
    assert decode.pool.num_used == 0


def test_sampled_handoff_needs_its_sampler_state(family, engines):
    prefill, decode = engines
    ids = prompt(6, seed=3)
    ev = handed(prefill, ids, SAMPLED)
    assert ev.rng_state is not None
    (err,) = submit(decode, ids, SAMPLED, resume=Resume(ev.package, [ev.token], None)).wait()
    assert isinstance(err, ErrorEvent) and "sampler state" in err.message
    junk = torch.zeros(7, dtype=torch.uint8)
    (err,) = submit(decode, ids, SAMPLED, resume=Resume(ev.package, [ev.token], junk)).wait()
    assert isinstance(err, ErrorEvent) and "sampler state" in err.message
