"""The model against an independent reference; KV cache, causality, RoPE, MoE, stages."""

from __future__ import annotations

import pytest
import torch
from model_reference import forward as reference_forward
from model_reference import moe as reference_moe
from moecomm_serving.kv.cache import INITIAL_CAPACITY
from moecomm_serving.model.checkpoint import Checkpoint, expert_names
from moecomm_serving.model.experts import LocalExperts, run_experts
from moecomm_serving.model.rope import RopeConfig, Rotary
from moecomm_serving.model.tiny import write_tiny
from moecomm_serving.model.transformer import MoETransformer, load_model, stage_tensor_names

# Float32 throughout; differences come from summation order only (packed vs. per-sequence
# matmuls, fused vs. looped experts), orders of magnitude below this.
ATOL = 1e-4


def prompt(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def all_tensors(request):
    """Every tensor of both tiny checkpoints, by layout."""
    out = {}
    for name, fixture in (("mixtral", "mixtral_dir"), ("qwen2_moe", "qwen_dir")):
        ckpt = Checkpoint(request.getfixturevalue(fixture))
        out[name] = ckpt.read(ckpt.files)
    return out


def test_matches_independent_reference(model, all_tensors):
    ids = prompt(11, seed=2)
    logits = model.forward([ids], [model.new_sequence()], all_logits=True)
    ref = reference_forward(model.config, all_tensors[model.config.model_type], ids)
    assert logits.shape == (11, model.config.vocab_size)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


def test_tied_embeddings(tmp_path):
    cfg = write_tiny(str(tmp_path), "mixtral", seed=4, overrides={"tie_word_embeddings": True})
    tensors = Checkpoint(tmp_path).read(Checkpoint(tmp_path).files)
    assert "lm_head.weight" not in tensors
    model = load_model(tmp_path)
    assert model.lm_head is model.embed_tokens
    last = load_model(tmp_path, layers=range(3, 4))  # the last stage needs the embedding too
    assert torch.equal(last.lm_head, tensors["model.embed_tokens.weight"])
    ids = prompt(7, seed=13)
    logits = model.forward([ids], [model.new_sequence()], all_logits=True)
    torch.testing.assert_close(logits, reference_forward(cfg, tensors, ids), atol=ATOL, rtol=0)


def test_cached_steps_equal_full_sequence(model):
    ids = prompt(9, seed=3)
    full = model.forward([ids], [model.new_sequence()], all_logits=True)
    cache = model.new_sequence()
    steps = [model.forward([[t]], [cache])[0] for t in ids]
    torch.testing.assert_close(torch.stack(steps), full, atol=ATOL, rtol=0)
    # a prefill of 5, then the rest in chunks of 1 and 3
    cache = model.new_sequence()
    parts = [ids[:5], ids[5:6], ids[6:]]
    chunks = [model.forward([p], [cache], all_logits=True) for p in parts]
    torch.testing.assert_close(torch.cat(chunks), full, atol=ATOL, rtol=0)
    assert cache.length == len(ids)


def test_ragged_batch_equals_separate_sequences(model):
    prompts = [prompt(n, seed=10 + n) for n in (1, 7, 4)]
    alone = [model.forward([p], [model.new_sequence()], all_logits=True) for p in prompts]
    caches = [model.new_sequence() for _ in prompts]
    batched = model.forward(prompts, caches, all_logits=True)
    torch.testing.assert_close(batched, torch.cat(alone), atol=ATOL, rtol=0)
    # then one decode step of all three together vs. each alone
    nxt = [[5], [6], [7]]
    step = model.forward(nxt, caches)
    for j, p in enumerate(prompts):
        ref = model.forward([p + nxt[j]], [model.new_sequence()])[0]
        torch.testing.assert_close(step[j], ref, atol=ATOL, rtol=0)


def test_future_tokens_do_not_change_past_logits(mixtral):
    ids = prompt(8, seed=4)
    other = ids[:5] + prompt(3, seed=99)
    a = mixtral.forward([ids], [mixtral.new_sequence()], all_logits=True)
    b = mixtral.forward([other], [mixtral.new_sequence()], all_logits=True)
    torch.testing.assert_close(a[:5], b[:5], atol=ATOL, rtol=0)
    assert not torch.allclose(a[5:], b[5:], atol=1e-2)  # the changed tokens do matter


def test_cache_grows_past_initial_capacity(mixtral):
    ids = prompt(INITIAL_CAPACITY + 9, seed=5)
    full = mixtral.forward([ids], [mixtral.new_sequence()], all_logits=True)
    cache = mixtral.new_sequence()
    head = mixtral.forward([ids[:60]], [cache], all_logits=True)
    tail = [mixtral.forward([[t]], [cache])[0] for t in ids[60:]]
    torch.testing.assert_close(torch.cat([head, torch.stack(tail)]), full, atol=ATOL, rtol=0)
    assert cache.layer(0).k.shape[1] == 2 * INITIAL_CAPACITY


def test_rope_scores_depend_only_on_relative_position():
    rope = Rotary(32, RopeConfig(theta=10000.0), "cpu")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 32, generator=g), torch.randn(1, 1, 32, generator=g)

    def score(pq, pk):
        a = rope(q, torch.tensor([pq]))
        b = rope(k, torch.tensor([pk]))
        return float((a * b).sum())

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)
    x = rope(q, torch.tensor([0]))
    assert torch.equal(x, q)  # position 0 is the identity
    assert torch.linalg.vector_norm(rope(q, torch.tensor([55]))) == pytest.approx(
        float(torch.linalg.vector_norm(q)), rel=1e-5
    )


def test_moe_layer_equals_per_expert_reference(model, all_tensors):
    cfg = model.config
    layer = cfg.sparse_layers[-1]
    block = model.block(layer)
    x = torch.randn(13, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    ids, weights = block.route(x)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == (13, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(13))
    routed = run_experts(model.experts, x, ids, weights, layer)
    y = block.finish(torch.zeros_like(x), x, routed)
    ref = reference_moe(cfg, all_tensors[cfg.model_type], layer, x)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=0)


def test_mixtral_routing_is_softmax_over_topk_logits(mixtral):
    """Mixtral's formulation: the top-k logits, then a softmax over just those."""
    block = mixtral.block(0)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(7))
    ids, weights = block.route(x)
    logits = x @ block.w[expert_names(mixtral.config).router(0).split("layers.0.")[1]].T
    top, top_ids = torch.topk(logits, 2)
    assert torch.equal(ids.long(), top_ids)
    torch.testing.assert_close(weights, torch.softmax(top, -1))


def test_pipeline_stages_equal_whole_model(mixtral, mixtral_dir):
    stages = [load_model(mixtral_dir, layers=r) for r in (range(0, 1), range(1, 3), range(3, 4))]
    prompts = [prompt(6, seed=8), prompt(3, seed=9)]
    whole = mixtral.forward(prompts, [mixtral.new_sequence() for _ in prompts], all_logits=True)
    caches = [[s.new_sequence() for _ in prompts] for s in stages]
    batch0 = stages[0].prepare(caches[0], [len(p) for p in prompts])
    h = stages[0].forward_hidden(
        stages[0].embed(torch.tensor([t for p in prompts for t in p])), batch0
    )
    for s, c in zip(stages[1:], caches[1:], strict=True):
        h = s.forward_hidden(h, s.prepare(c, [len(p) for p in prompts]))
    assert torch.equal(stages[2].logits(h), whole)
    with pytest.raises(RuntimeError, match="owns layer 0"):
        stages[1].embed(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="owns the last layer"):
        stages[0].logits(h)


def test_kv_migration_between_stages(mixtral, mixtral_dir):
    """Moving layer 1's cache from one stage's sequence to another's keeps decoding exact."""
    a, b = load_model(mixtral_dir, layers=range(0, 2)), load_model(mixtral_dir, layers=range(2, 4))
    ids = prompt(5, seed=11)
    ca, cb = a.new_sequence(), b.new_sequence()
    h = a.forward_hidden(a.embed(torch.tensor(ids)), a.prepare([ca], [5]))
    b.forward_hidden(h, b.prepare([cb], [5]))
    a2, b2 = (
        load_model(mixtral_dir, layers=range(0, 1)),
        load_model(mixtral_dir, layers=range(1, 4)),
    )
    cb.put_layer(1, ca.pop_layer(1))
    h = a2.forward_hidden(a2.embed(torch.tensor([42])), a2.prepare([ca], [1]))
    out = b2.logits(b2.forward_hidden(h, b2.prepare([cb], [1])))
    ref = mixtral.forward([[*ids, 42]], [mixtral.new_sequence()])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_bad_inputs_are_rejected(mixtral):
    c = mixtral.new_sequence()
    with pytest.raises(ValueError, match="token ids must be in"):
        mixtral.forward([[mixtral.config.vocab_size]], [c])
    with pytest.raises(ValueError, match="at least one new token"):
        mixtral.forward([[]], [c])
    with pytest.raises(ValueError, match="appears twice"):
        mixtral.forward([[1], [2]], [c, c])
    with pytest.raises(ValueError, match="2 caches but 1"):
        mixtral.prepare([c, mixtral.new_sequence()], [1])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        mixtral.prepare([c], [mixtral.config.max_position_embeddings + 1])
    assert c.length == 0  # nothing was appended by the rejected calls


def test_load_model_checks(mixtral_dir, qwen_dir):
    with pytest.raises(ValueError, match="contiguous range"):
        load_model(mixtral_dir, layers=range(0, 4, 2))
    with pytest.raises(ValueError, match="contiguous range"):
        load_model(mixtral_dir, layers=range(2, 5))
    with pytest.raises(ValueError, match="pass an experts backend"):
        load_model(mixtral_dir, experts=None)
    ckpt = Checkpoint(mixtral_dir)
    tensors = ckpt.read(stage_tensor_names(ckpt.config, range(3, 4)))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)
    with pytest.raises(ValueError, match="mix dtypes"):
        MoETransformer(ckpt.config, tensors, LocalExperts({}), range(3, 4))
    dense = load_model(qwen_dir, experts=None, layers=range(1, 2))  # no MoE layer: no experts
    assert dense.experts is None


def test_local_experts_checks(mixtral_dir):
    hosted = Checkpoint(mixtral_dir).read_experts({0: range(16)})
    with pytest.raises(ValueError, match="without gaps"):
        LocalExperts({0: {e: w for e, w in hosted[0].items() if e != 4}})
    local = LocalExperts(hosted)
    x = torch.zeros(2, 256)
    with pytest.raises(ValueError, match="no local experts for layer 1"):
        local.dispatch(x, torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2), 1)
    with pytest.raises(ValueError, match="outside"):
        local.dispatch(x, torch.full((2, 2), 16, dtype=torch.int32), torch.ones(2, 2), 0)


class _FailOnce:
    """Local experts that, once armed, raise once at one layer, like a server lost mid-step."""

    def __init__(self, inner, layer):
        self.inner, self.layer, self.armed = inner, layer, False

    def dispatch(self, x, ids, w, layer_id):
        if layer_id == self.layer and self.armed:
            self.armed = False
            raise ConnectionError("expert server lost")
        return self.inner.dispatch(x, ids, w, layer_id)

    def combine(self, handle):
        return self.inner.combine(handle)


def test_failed_step_rolls_back_and_retries(mixtral, mixtral_dir):
    flaky = load_model(mixtral_dir, experts=_FailOnce(mixtral.experts, layer=2))
    ids = prompt(6, seed=12)
    cache = flaky.new_sequence()
    flaky.forward([ids[:4]], [cache])
    flaky.experts.armed = True
    with pytest.raises(ConnectionError):
        flaky.forward([ids[4:]], [cache])
    assert cache.length == 4  # layers 0-1 had appended; rolled back with the rest
    out = flaky.forward([ids[4:]], [cache], all_logits=True)
    ref = mixtral.forward([ids], [mixtral.new_sequence()], all_logits=True)[4:]
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch")
def test_cuda_model_matches_cpu(mixtral, mixtral_dir):
    """The same forward on a CUDA device (float32; TF32 off so the tolerance holds)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = load_model(mixtral_dir, device="cuda")
    prompts = [prompt(6, seed=14), prompt(2, seed=15)]
    want = mixtral.forward(prompts, [mixtral.new_sequence() for _ in prompts], all_logits=True)
    got = gpu.forward(prompts, [gpu.new_sequence() for _ in prompts], all_logits=True)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), want, atol=ATOL, rtol=0)
