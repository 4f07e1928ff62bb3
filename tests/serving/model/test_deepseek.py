"""DeepSeek-V3 specifics: the MLA cache holds the latent and the rotated key (not decompressed
keys/values), decoding from it equals a full forward, pipeline stages migrate it, and the
grouped sigmoid router."""

import pytest
import torch
from moecomm.pipeline.driver import run_decode
from moecomm_serving.engine.generate import generate
from moecomm_serving.engine.stages import model_pipeline
from moecomm_serving.model.config import MoEConfig, UnsupportedConfigError
from moecomm_serving.model.deepseek import DeepseekLayer
from moecomm_serving.model.layer import rms_norm
from moecomm_serving.model.tiny import tiny_config, write_tiny
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams

PROMPT = [5, 17, 200, 33, 90, 12, 7, 250, 64, 3]
STAGE_LAYERS = 4  # two stages of two layers; a remap moves one across
PIPE_NEW = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek")
    write_tiny(str(path), "deepseek_v3")
    return load_model(path, dtype=torch.float32)


def test_cache_holds_latent_and_rope_key_per_token(model):
    m = model.config.mla
    cache = model.new_sequence()
    model.forward([PROMPT], [cache])
    assert cache.length == len(PROMPT)
    for i in model.layers:
        kv = cache.layer(i)
        # one "head": the kv_a_layernorm'd latent in k, the rotated shared key in v
        assert kv.k.shape[0] == kv.v.shape[0] == 1
        assert kv.k.shape[2] + kv.v.shape[2] == m.kv_lora_rank + m.qk_rope_head_dim
        assert kv.k.shape[2] == m.kv_lora_rank
    # the latent is what kv_a_layernorm gives, not a decompressed key: recompute layer 0's
    block = model.block(0)
    x = rms_norm(model.embed(torch.tensor(PROMPT)), block.w["input_layernorm.weight"], 1e-6)
    latent = x @ block.w["self_attn.kv_a_proj_with_mqa.weight"][: m.kv_lora_rank].T
    latent = rms_norm(latent, block.w["self_attn.kv_a_layernorm.weight"], 1e-6)
    torch.testing.assert_close(cache.layer(0).k[0, : len(PROMPT)], latent)
    heads, k_dim, v_dim = model.kv_shape
    assert heads * (k_dim + v_dim) == m.kv_lora_rank + m.qk_rope_head_dim


def test_decoding_from_the_latent_cache_equals_a_full_forward(model):
    full = model.forward([PROMPT], [model.new_sequence()], all_logits=True)
    cache = model.new_sequence()
    steps = [model.forward([PROMPT[:6]], [cache])[0]]
    steps += [model.forward([[t]], [cache])[0] for t in PROMPT[6:]]
    torch.testing.assert_close(torch.stack(steps), full[5:], atol=1e-5, rtol=0)


def test_router_keeps_to_the_best_groups_and_scales_weights(model):
    c, m = model.config, model.config.mla
    layer = next(b for b in model.blocks if b.sparse)
    assert isinstance(layer, DeepseekLayer)
    x = torch.randn(64, c.hidden_size, generator=torch.Generator().manual_seed(1))
    ids, weights = layer.route(x)
    per_group = c.num_experts // m.n_group
    groups = (ids // per_group).long()
    assert all(len(set(row.tolist())) <= m.topk_group for row in groups)
    # norm_topk_prob: the weights of a token sum to routed_scaling_factor
    torch.testing.assert_close(
        weights.sum(-1), torch.full((64,), m.routed_scaling_factor), atol=1e-5, rtol=0
    )


@pytest.mark.timeout(120)
def test_pipeline_stages_migrate_the_latent_cache(tmp_path):
    """Two stage processes, a layer moved between them mid-decode (its latent cache migrates):
    greedy tokens equal in-process generation."""
    write_tiny(str(tmp_path), "deepseek_v3", overrides={"num_hidden_layers": STAGE_LAYERS})
    prompts = [PROMPT[: 3 + 2 * i] for i in range(3)]
    params = SamplingParams(max_new_tokens=PIPE_NEW, ignore_eos=True)
    want = [g.tokens for g in generate(load_model(tmp_path, dtype=torch.float32), prompts, params)]
    with model_pipeline(tmp_path, 2) as pipe:
        run = run_decode(pipe, prompts, PIPE_NEW, forced={3: 1, 7: 0})
    assert run.tokens == want
    assert [k for _, k in run.remaps] == [1, 0]


def test_config_defaults_are_transformers_and_bad_values_are_refused():
    d = tiny_config("deepseek_v3")
    for key in ("routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace"):
        del d[key]
    c = MoEConfig.from_dict(d)  # DeepseekV3Config's defaults fill in
    assert (c.mla.routed_scaling_factor, c.mla.n_group, c.mla.topk_group) == (2.5, 8, 4)
    assert c.sparse_layers == (3,)
    bad = [
        ({"n_group": 3}, ValueError, "n_group"),
        ({"topk_group": 1, "num_experts_per_tok": 8}, ValueError, "top-8"),
        ({"num_key_value_heads": 2}, UnsupportedConfigError, "num_key_value_heads"),
        ({"scoring_func": "softmax"}, UnsupportedConfigError, "scoring_func"),
        ({"topk_method": "greedy"}, UnsupportedConfigError, "topk_method"),
    ]
    for overrides, error, match in bad:
        with pytest.raises(error, match=match):
            MoEConfig.from_dict(tiny_config("deepseek_v3", overrides))
