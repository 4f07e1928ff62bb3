"""The prefix cache: hits bit-identical to misses for every family, chained keys, LRU eviction
under a byte budget, blocks in use never evicted, the engine's reuse across requests and its
/metrics series."""

from __future__ import annotations

import argparse
import json
import urllib.request

import pytest
import torch
from moecomm_serving.api.app import FrontendSettings, make_frontend_app, start_frontend
from moecomm_serving.api.metrics import ServingMetrics
from moecomm_serving.cli.common import add_kv_cache_arguments, kv_cache_kwargs
from moecomm_serving.engine.generate import generate
from moecomm_serving.engine.scheduler import Engine, run_to_completion
from moecomm_serving.kv.blocks import DEFAULT_BLOCK_TOKENS, BlockPool, PagedSequence
from moecomm_serving.kv.prefix_cache import PrefixCache, block_keys
from moecomm_serving.model.tiny import write_tiny
from moecomm_serving.model.tokenizer import load_tokenizer
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
BLOCK = 8
TIMEOUT_S = 120.0
BIG = 1 << 30  # a budget no test fills


def prompt(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=ARCHS)
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"prefix-{request.param}")
    write_tiny(str(path), request.param, seed=0)
    return load_model(path, dtype=torch.float32)


def test_hit_is_bit_identical_to_miss(family):
    shared = prompt(2 * BLOCK + 3, seed=1)
    first, second = [*shared, 9, 4], [*shared, 100, 101, 102]
    pool = family.new_block_pool(BLOCK)
    cache = PrefixCache(pool, BIG)
    seq = family.new_sequence(pool)
    family.forward([first], [seq])
    assert cache.insert(first, seq) == 2  # full blocks only: 21 tokens hold two
    seq.release()
    assert pool.num_used == 2  # the cache keeps them after the request
    plain = family.new_sequence()  # the miss: the old cache, the whole prompt prefilled
    miss = family.forward([second], [plain], all_logits=True)
    blocks, n = cache.match(second)
    assert n == 2 * BLOCK
    hit = family.new_sequence(pool)
    hit.adopt(blocks, n)
    got = family.forward([second[n:]], [hit], all_logits=True)
    assert torch.equal(got, miss[n:])
    # and the decode steps after it
    assert torch.equal(family.forward([[5]], [hit]), family.forward([[5]], [plain]))


def test_generate_with_prefix_cache_equals_without(family):
    shared = prompt(3 * BLOCK, seed=2)
    prompts = [[*shared, 1, 2], [*shared, 3]]
    params = SamplingParams(3, ignore_eos=True)
    want = [g.tokens for g in generate(family, prompts, params)]
    cache = PrefixCache(family.new_block_pool(BLOCK), BIG)
    generate(family, [[*shared, 77]], params, prefix_cache=cache)  # warms the cache
    gens = generate(family, prompts, params, prefix_cache=cache)
    assert [g.tokens for g in gens] == want
    assert [g.cached for g in gens] == [3 * BLOCK, 3 * BLOCK]
    assert cache.stats.hits == 2 and cache.stats.lookups == 3


# ---------------------------------------------------------------- the cache alone, no model
HEADS, KD, VD = 1, 2, 2


def pool_of(blocks=4):
    return BlockPool((0,), HEADS, KD, VD, torch.float32, "cpu", 4, blocks)


def cached(pool, tokens, seed=0):
    """A sequence of `tokens` with random keys (what a forward would have written)."""
    seq = PagedSequence(pool)
    g = torch.Generator().manual_seed(seed)
    n = len(tokens)
    seq.layer(0).append(
        torch.randn(HEADS, n, KD, generator=g), torch.randn(HEADS, n, VD, generator=g)
    )
    return seq


def test_keys_chain_over_the_whole_prefix():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_keys([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0]
    assert a[1] != b[1]  # same block tokens after another prefix: another key
    assert block_keys([1, 2, 3], 4) == []  # no full block


def test_last_prompt_token_is_never_served_and_partial_blocks_not_kept():
    pool = pool_of()
    cache = PrefixCache(pool, BIG)
    tokens = list(range(10))
    seq = cached(pool, tokens)
    assert cache.insert(tokens, seq) == 2  # 10 tokens: two full blocks of 4
    # a prompt that is exactly the two blocks gets one: its last token must be prefilled
    blocks, n = cache.match(tokens[:8])
    assert n == 4 and blocks == seq.table[:1]
    pool.unref(blocks[0])
    # a prompt that diverges inside the second block gets the first only
    blocks, n = cache.match([0, 1, 2, 3, 4, 5, 99, 7, 8])
    assert n == 4
    pool.unref(blocks[0])
    assert cache.match([5, 1, 2, 3, 4]) == ([], 0)
    s = cache.stats
    assert (s.lookups, s.hits, s.hit_tokens, s.query_tokens) == (3, 2, 8, 22)


def test_lru_eviction_under_a_tiny_budget():
    pool = pool_of()
    cache = PrefixCache(pool, 2 * pool.block_bytes)  # room for two blocks
    seqs = {}
    for name, first in (("a", 10), ("b", 20), ("c", 30)):
        tokens = [*range(first, first + 4), 0]
        seqs[name] = cached(pool, tokens)
        assert cache.insert(tokens, seqs[name]) == 1
        seqs[name].release()
    assert cache.num_blocks == 2 and cache.bytes == 2 * pool.block_bytes
    assert cache.stats.evicted_blocks == 1
    assert cache.match([10, 11, 12, 13, 0]) == ([], 0)  # a, least recently used, went
    blocks, n = cache.match([20, 21, 22, 23, 0])  # b is used again: now c is the oldest
    assert n == 4
    pool.unref(blocks[0])
    d = cached(pool, [40, 41, 42, 43, 0])
    cache.insert([40, 41, 42, 43, 0], d)
    assert cache.match([30, 31, 32, 33, 0]) == ([], 0)
    assert cache.match([20, 21, 22, 23, 0])[1] == 4


def test_block_in_use_is_never_evicted():
    pool = pool_of()
    cache = PrefixCache(pool, pool.block_bytes)  # one block
    tokens = [1, 2, 3, 4, 5]
    owner = cached(pool, tokens, seed=3)
    want = owner.gather(0)
    assert cache.insert(tokens, owner) == 1
    owner.release()
    blocks, n = cache.match(tokens)  # a running request holds the block now
    user = PagedSequence(pool)
    user.adopt(blocks, n)
    other = cached(pool, [7, 7, 7, 7, 7], seed=4)
    assert cache.insert([7, 7, 7, 7, 7], other) == 0  # no room, and the held block stays
    assert cache.num_blocks == 1 and cache.stats.evicted_blocks == 0
    assert torch.equal(user.gather(0)[0], want[0][:, :4])
    user.release()  # now it is only the cache's: the next insert may evict it
    assert cache.insert([7, 7, 7, 7, 7], other) == 1
    assert cache.stats.evicted_blocks == 1
    other.release()
    cache.clear()
    assert pool.num_used == 0  # every reference accounted for


def test_zero_budget_keeps_nothing_and_bad_input_refused():
    pool = pool_of()
    cache = PrefixCache(pool, 0)
    seq = cached(pool, list(range(9)))
    assert cache.insert(list(range(9)), seq) == 0 and cache.match(list(range(9))) == ([], 0)
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(pool, -1)
    with pytest.raises(ValueError, match="another block pool"):
        cache.insert(list(range(9)), cached(pool_of(), list(range(9))))


# ---------------------------------------------------------------- the engine
def test_engine_reuses_prefixes_across_requests(mixtral):
    shared = prompt(4 * BLOCK, seed=5)
    prompts = [[*shared, i, i + 1] for i in range(3)]
    params = SamplingParams(3, ignore_eos=True)
    plain = Engine(mixtral, max_batch_tokens=64, kv_block_tokens=None).start()
    try:
        want = run_to_completion(plain, prompts, params, TIMEOUT_S)
    finally:
        plain.stop()
    engine = Engine(
        mixtral, max_batch_tokens=64, kv_block_tokens=BLOCK, prefix_cache_bytes=BIG
    ).start()
    try:
        # one request first (it fills the cache), then the others reuse its prefix
        first = run_to_completion(engine, prompts[:1], params, TIMEOUT_S)
        rest = run_to_completion(engine, prompts[1:], params, TIMEOUT_S)
    finally:
        engine.stop()
    assert first + rest == want
    stats = engine.prefix_cache.stats
    assert stats.hits == 2 and stats.hit_tokens == 2 * 4 * BLOCK
    # valued at the fitted cost per token (a timing: its value is the bench's business)
    assert stats.saved_prefill_s >= 0 and engine.seconds_per_token() is not None
    # every running request's blocks were freed; what is left is the cache's
    assert engine.pool.num_used == engine.prefix_cache.num_blocks
    metrics = ServingMetrics(lambda: 0, lambda: 0, lambda: 0, prefix_cache=engine.prefix_cache)
    text = metrics.render()
    series = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("moecomm_prefix")
    )
    assert float(series["moecomm_prefix_cache_hit_tokens_total"]) == 2 * 4 * BLOCK
    assert float(series["moecomm_prefix_cache_hits_total"]) == 2
    rate = 2 * 4 * BLOCK / sum(len(p) for p in prompts)
    assert float(series["moecomm_prefix_cache_hit_rate"]) == pytest.approx(rate)
    assert float(series["moecomm_prefix_cache_bytes"]) == engine.prefix_cache.bytes > 0
    saved = float(series["moecomm_prefix_cache_saved_prefill_seconds_total"])
    assert saved == pytest.approx(stats.saved_prefill_s)


def test_engine_refuses_prefix_cache_without_paging(mixtral):
    with pytest.raises(ValueError, match="paged"):
        Engine(mixtral, max_batch_tokens=8, kv_block_tokens=None, prefix_cache_bytes=1)
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        Engine(mixtral, max_batch_tokens=8, prefix_cache_bytes=-1)


# ---------------------------------------------------------------- front end and options
def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        return json.loads(r.read())


def test_frontend_metrics_show_the_prefix_cache(tiny_mixtral_dir, mixtral):
    tok = load_tokenizer(tiny_mixtral_dir, mixtral.config)
    settings = FrontendSettings("tiny", 64, kv_block_tokens=BLOCK, prefix_cache_bytes=BIG)
    app = make_frontend_app(mixtral, tok, settings)
    server = start_frontend(app)
    try:
        shared = prompt(3 * BLOCK, seed=6)
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        outs = [
            _post(f"{server.url}/v1/completions", {**body, "prompt": [*shared, i]})
            for i in range(2)
        ]
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=TIMEOUT_S) as r:
            text = r.read().decode()
    finally:
        server.stop()
    assert all(o["usage"]["completion_tokens"] == 2 for o in outs)
    series = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("moecomm_"))
    assert float(series["moecomm_prefix_cache_lookups_total"]) == 2
    assert float(series["moecomm_prefix_cache_hit_tokens_total"]) == 3 * BLOCK
    per_token = app.state.frontend.engine.pool.block_bytes // BLOCK
    assert float(series["moecomm_prefix_cache_hit_bytes_total"]) == 3 * BLOCK * per_token
    assert float(series["moecomm_prefix_cache_capacity_bytes"]) == BIG


def test_cache_options():
    p = argparse.ArgumentParser()
    add_kv_cache_arguments(p)
    assert kv_cache_kwargs(p.parse_args([]), "x") == {
        "kv_block_tokens": DEFAULT_BLOCK_TOKENS,
        "prefix_cache_bytes": 0,
    }
    args = p.parse_args(["--kv-block-tokens", "0"])
    assert kv_cache_kwargs(args, "x")["kv_block_tokens"] is None  # the old cache
    for bad in (
        ["--prefix-cache-bytes", "-1"],
        ["--kv-block-tokens", "0", "--prefix-cache-bytes", "9"],
    ):
        with pytest.raises(SystemExit):
            kv_cache_kwargs(p.parse_args(bad), "x")


def test_saved_time_is_valued_at_the_marginal_cost_per_token(mixtral):
    engine = Engine(mixtral, max_batch_tokens=8, prefix_cache_bytes=BIG)  # not started
    assert engine.seconds_per_token() is None
    for _ in range(3):
        engine._note_step(0.050, 1)  # equal steps: no slope, the mean cost per token
    assert engine.seconds_per_token() == pytest.approx(0.050)
    fixed, per_token = 0.050, 0.002
    for tokens in (1, 1, 500, 1, 3, 40, 1):
        engine._note_step(fixed + per_token * tokens, tokens)
    assert engine.seconds_per_token() == pytest.approx(per_token, rel=0.05)
    engine._note_hit(100)
    assert engine.prefix_cache.stats.saved_prefill_s == pytest.approx(100 * per_token, rel=0.05)
