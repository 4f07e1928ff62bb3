"""The paged KV cache (kv_blocks): bit-identical to the growable cache for every family, block
bookkeeping (growth, truncation, copy on write, release, a fixed-size placed pool), blocks held
for a hand-off (export holds, a reservation checks the metadata once, import adopts, a dropped
hold frees), and refusals of bad input."""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import replace

import pytest
import torch
from moecomm_serving.engine.generate import generate
from moecomm_serving.engine.scheduler import Engine, EngineRequest, run_to_completion
from moecomm_serving.kv.blocks import BlockPool, HeldBlocks, KvPoolFullError, PagedSequence
from moecomm_serving.model.tiny import write_tiny
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams, TokenEvent

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# Small blocks so the test prompts span several blocks and end inside one.
BLOCK = 8
LENGTHS = (5, 19)  # one prompt inside a block, one over two boundaries
DECODES = 2
TIMEOUT_S = 120.0


def prompt(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=ARCHS)
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"paged-{request.param}")
    write_tiny(str(path), request.param, seed=0)
    return load_model(path, dtype=torch.float32)


def run(model, caches, prompts):
    """A ragged prefill of both prompts, then DECODES batched steps; all logits."""
    out = [model.forward(prompts, caches, all_logits=True)]
    for step in range(DECODES):
        out.append(model.forward([[7 + step], [11 + step]], caches))
    return torch.cat(out)


def test_paged_is_bit_identical_to_growable_cache(family):
    prompts = [prompt(n, seed=n) for n in LENGTHS]
    old = run(family, [family.new_sequence() for _ in prompts], prompts)
    pool = family.new_block_pool(BLOCK)
    seqs = [family.new_sequence(pool) for _ in prompts]
    new = run(family, seqs, prompts)
    assert torch.equal(new, old)  # same bytes, not merely close
    want = [pool.blocks_for(n + DECODES) for n in LENGTHS]
    assert [len(s.table) for s in seqs] == want
    assert len({b for s in seqs for b in s.table}) == sum(want)  # no block shared by accident
    for s in seqs:
        s.release()
    assert pool.num_used == 0


def test_greedy_generation_equal_paged_and_not(family):
    prompts = [prompt(n, seed=3 * n) for n in LENGTHS]
    params = SamplingParams(3, ignore_eos=True)
    pool = family.new_block_pool(BLOCK)
    want = [g.tokens for g in generate(family, prompts, params)]
    got = [g.tokens for g in generate(family, prompts, params, pool=pool)]
    assert got == want
    assert pool.num_used == 0  # generate freed every block


def test_mla_blocks_hold_latent_and_rope_key(tmp_path):
    write_tiny(str(tmp_path), "deepseek_v3", seed=0)
    model = load_model(tmp_path, dtype=torch.float32)
    m = model.config.mla
    pool = model.new_block_pool(BLOCK)
    layer = model.layers.start
    assert pool.k[layer].shape[1:] == (1, BLOCK, m.kv_lora_rank)
    assert pool.v[layer].shape[1:] == (1, BLOCK, m.qk_rope_head_dim)
    elem = torch.empty((), dtype=torch.float32).element_size()
    per_token = (m.kv_lora_rank + m.qk_rope_head_dim) * elem * len(model.layers)
    assert pool.block_bytes == per_token * BLOCK


# ---------------------------------------------------------------- bookkeeping, no model
HEADS, KD, VD = 2, 3, 5


def small_pool(block=4, initial=2, layers=(0, 1)):
    return BlockPool(layers, HEADS, KD, VD, torch.float32, "cpu", block, initial)


def kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(HEADS, n, KD, generator=g), torch.randn(HEADS, n, VD, generator=g)


def fill(seq, n, seed):
    k, v = kv(n, seed)
    for layer in seq.layers:
        seq.layer(layer).append(k, v)
    return k, v


def test_pool_grows_and_keeps_contents():
    pool = small_pool(block=4, initial=2)
    seq = PagedSequence(pool)
    k, v = fill(seq, 3, seed=1)
    k2, v2 = fill(seq, 14, seed=2)  # 17 tokens: 5 blocks, past the 2 the pool started with
    assert pool.capacity >= 5 and len(seq.table) == 5
    keys, values = seq.gather(0)
    assert torch.equal(keys, torch.cat([k, k2], 1)) and torch.equal(values, torch.cat([v, v2], 1))


def test_truncate_frees_blocks_and_layers_roll_back_independently():
    pool = small_pool(block=4, initial=8)
    seq = PagedSequence(pool)
    fill(seq, 10, seed=3)
    assert pool.num_used == 3
    # a failed forward rolls back: layer 0 had appended, layer 1 had not
    k, v = kv(3, seed=4)
    seq.layer(0).append(k, v)
    with pytest.raises(RuntimeError, match="disagree"):
        _ = seq.length
    seq.layer(0).truncate(10)
    assert seq.length == 10 and pool.num_used == 3
    seq.truncate(4)
    assert pool.num_used == 1 and seq.table == seq.table[:1]
    seq.release()
    seq.release()  # idempotent
    assert pool.num_used == 0
    with pytest.raises(RuntimeError, match="released"):
        seq.layer(0)


def test_copy_on_write_keeps_a_shared_block_intact():
    pool = small_pool(block=4, initial=8)
    a = PagedSequence(pool)
    k, v = fill(a, 8, seed=5)
    shared = list(a.table)
    for b in shared:
        pool.ref(b)  # b adopts a's two full blocks
    b = PagedSequence(pool)
    b.adopt(shared, 8)
    b.truncate(6)  # into a's second block, then overwrite its last two tokens
    fill(b, 2, seed=6)
    assert b.table[0] == a.table[0] and b.table[1] != a.table[1]  # copied, not written
    assert torch.equal(a.gather(1)[0], k) and torch.equal(a.gather(1)[1], v)
    assert torch.equal(b.gather(1)[0][:, :6], k[:, :6])
    a.release()
    b.release()
    assert pool.num_used == 0


def move(held: HeldBlocks, dst: HeldBlocks) -> None:
    """What the KV transfer does between two pools' memory (moecomm.wire.kv), here by torch."""
    src_pool, dst_pool = held.pool, dst.pool
    for layer in src_pool.layers:
        for a, b in ((src_pool.k, dst_pool.k), (src_pool.v, dst_pool.v)):
            b[layer][list(dst.blocks)] = a[layer][list(held.blocks)]


def test_export_holds_and_import_adopts_bit_identically(mixtral):
    ids = prompt(13, seed=8)
    src_pool, dst_pool = mixtral.new_block_pool(BLOCK), mixtral.new_block_pool(BLOCK)
    src = mixtral.new_sequence(src_pool)
    mixtral.forward([ids], [src])
    held = src.export_blocks()
    assert held.package.length == 13 and len(held.blocks) == 2
    assert all(src_pool.refcount(b) == 2 for b in held.blocks)  # the sequence's and the hold's
    dst = HeldBlocks.reserve(dst_pool, held.package)
    assert dst_pool.num_used == 2
    move(held, dst)
    seq = PagedSequence.import_blocks(dst_pool, dst)
    assert seq.length == 13 and seq.table == list(dst.blocks) and dst_pool.num_used == 2
    dst.release()  # adopted: releasing the hold frees nothing
    assert dst_pool.num_used == 2
    want = mixtral.forward([[42]], [src])
    got = mixtral.forward([[42]], [seq])
    assert torch.equal(got, want)
    src.release()
    assert src_pool.num_used == 2  # still held for the hand-off
    held.release()
    held.release()  # idempotent
    assert src_pool.num_used == 0


def test_held_blocks_are_written_by_nobody_else():
    """A block held for a hand-off is shared: a sequence writing into it copies it first."""
    pool = small_pool()
    seq = PagedSequence(pool)
    fill(seq, 3, seed=3)  # one block, not full
    held = seq.export_blocks()
    before = pool.k[0][held.blocks[0]].clone()
    fill(seq, 1, seed=4)  # appends into the held block: copy on write
    assert seq.table[0] != held.blocks[0]
    assert torch.equal(pool.k[0][held.blocks[0]], before)
    held.release()
    seq.release()
    assert pool.num_used == 0


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda p: p.meta(), "KvPackage"),  # a dict of its fields is not a package
        (lambda p: replace(p, version=99), "version"),
        (lambda p: replace(p, block_tokens=16), "block_tokens"),
        (lambda p: replace(p, layers=(0,)), "layers"),
        (lambda p: replace(p, kv_shape=(1, 2, 3)), "kv_shape"),
        (lambda p: replace(p, dtype="bfloat16"), "dtype"),
        (lambda p: replace(p, length=0), "length"),
        (lambda p: replace(p, length=-1), "length"),
    ],
)
def test_a_reservation_checks_the_metadata(change, match):
    src = PagedSequence(small_pool())
    fill(src, 7, seed=9)
    held = src.export_blocks()
    dst_pool = small_pool()
    with pytest.raises(ValueError, match=match):
        HeldBlocks.reserve(dst_pool, change(held.package))
    assert dst_pool.num_used == 0  # nothing allocated for a refused package
    held.release()


def test_import_takes_only_held_blocks_of_its_pool_once():
    src = PagedSequence(small_pool())
    fill(src, 7, seed=10)
    held = src.export_blocks()
    pool = small_pool()
    with pytest.raises(ValueError, match="HeldBlocks"):
        PagedSequence.import_blocks(pool, held.package)  # metadata alone is no cache
    with pytest.raises(ValueError, match="another KV pool"):
        PagedSequence.import_blocks(pool, held)
    dst = HeldBlocks.reserve(pool, held.package)
    assert PagedSequence.import_blocks(pool, dst).length == 7
    with pytest.raises(ValueError, match="taken already"):
        PagedSequence.import_blocks(pool, dst)
    held.release()
    with pytest.raises(ValueError, match="released already"):
        held.take()


def test_a_dropped_hold_frees_its_blocks():
    """A hand-off lost on any path (an event nobody read) gives its blocks back when it is
    collected."""
    pool = small_pool()
    seq = PagedSequence(pool)
    fill(seq, 9, seed=11)
    held = seq.export_blocks()
    seq.release()
    assert pool.num_used == 3
    del held
    gc.collect()
    assert pool.num_used == 0


def test_a_placed_pool_has_a_fixed_capacity():
    pool = small_pool(block=4, initial=2)
    cap = 3
    k = {i: torch.zeros(cap, HEADS, 4, KD) for i in pool.layers}
    v = {i: torch.zeros(cap, HEADS, 4, VD) for i in pool.layers}
    with pytest.raises(ValueError, match="needs"):
        pool.place(k, {i: torch.zeros(cap, HEADS, 4, KD + 1) for i in pool.layers})
    pool.place(k, v)
    assert pool.capacity == cap and not pool.growable and pool.k[0] is k[0]
    seq = PagedSequence(pool)
    fill(seq, 8, seed=12)  # two blocks, written into the placed tensors
    assert torch.count_nonzero(k[0]) > 0
    with pytest.raises(KvPoolFullError, match="2 blocks wanted, 1 of 3 free"):
        pool.allocate_many(2)
    assert pool.num_used == 2  # all or none
    with pytest.raises(KvPoolFullError):
        fill(seq, 8, seed=13)  # would need a fourth block
    with pytest.raises(RuntimeError, match="in use"):
        pool.place(k, v)
    seq.release()
    assert pool.num_used == 0


def test_bad_input_refused(mixtral):
    pool = small_pool()
    seq = PagedSequence(pool)
    k, v = kv(2, seed=0)
    with pytest.raises(ValueError, match="append wants"):
        seq.layer(0).append(k[:, :, :2], v)
    with pytest.raises(ValueError, match="append wants"):
        seq.layer(0).append(k, v[:, :1])
    with pytest.raises(KeyError, match="not layer 7"):
        seq.layer(7)
    with pytest.raises(ValueError, match="outside"):
        seq.layer(0).truncate(1)
    with pytest.raises(ValueError, match="block_tokens"):
        small_pool(block=0)
    with pytest.raises(ValueError, match="at least one layer"):
        small_pool(layers=())
    with pytest.raises(ValueError, match="does not fit"):
        mixtral.new_sequence(small_pool())
    with pytest.raises(RuntimeError, match="dropped twice"):
        pool.unref(pool.capacity - 1)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.refcount(pool.capacity)
    fill(seq, 4, seed=1)
    with pytest.raises(RuntimeError, match="empty sequence"):
        seq.adopt([], 0)


# ---------------------------------------------------------------- the engine frees blocks
class _FailOnce:
    """Local experts that, once armed, raise once at one layer (a server lost mid-step)."""

    def __init__(self, inner, layer):
        self.inner, self.layer, self.armed = inner, layer, False

    def dispatch(self, x, ids, w, layer_id):
        if layer_id == self.layer and self.armed:
            self.armed = False
            raise ConnectionError("expert server lost")
        return self.inner.dispatch(x, ids, w, layer_id)

    def combine(self, handle):
        return self.inner.combine(handle)


def test_engine_frees_blocks_of_failed_cancelled_and_finished_requests(mixtral, mixtral_dir):
    flaky = load_model(mixtral_dir, experts=_FailOnce(mixtral.experts, layer=2))
    engine = Engine(flaky, max_batch_tokens=64, kv_block_tokens=BLOCK).start()
    params = SamplingParams(3, ignore_eos=True)
    ids = prompt(2 * BLOCK + 1, seed=10)
    try:
        flaky.experts.armed = True
        with pytest.raises(RuntimeError, match="expert server lost"):
            run_to_completion(engine, [ids], params, TIMEOUT_S)
        assert engine.pool.num_used == 0 and engine.stats.step_failures == 1
        # a request cancelled while it runs leaves no block behind either
        started = threading.Event()

        def emit(ev):
            if isinstance(ev, TokenEvent):
                req.cancel()
                started.set()

        req = EngineRequest(
            ids, SamplingParams(50, ignore_eos=True), emit, time.monotonic() + TIMEOUT_S
        )
        engine.submit(req)
        assert started.wait(TIMEOUT_S)
        deadline = time.monotonic() + TIMEOUT_S
        while engine.num_running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_running == 0 and engine.pool.num_used == 0
        got = run_to_completion(engine, [ids], params, TIMEOUT_S)
    finally:
        engine.stop()
    assert got == [g.tokens for g in generate(mixtral, [ids], params)]
    assert engine.pool.num_used == 0
