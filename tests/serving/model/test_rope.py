"""Rope configs in both layouts, each family's defaults, and the inverse frequencies of every
implemented rope type against transformers' own ``ROPE_INIT_FUNCTIONS``."""

from __future__ import annotations

import pytest
import torch
import transformers
from moecomm_serving.model.config import MoEConfig, UnsupportedConfigError
from moecomm_serving.model.rope import RopeConfig, inv_freq_and_scale, read_rope
from moecomm_serving.model.tiny import tiny_config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

HEAD_DIM = 32
MAX_POS = 2048
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
# DeepSeek-V3's released shape: mscale pair and beta bounds given, attention_factor derived.
YARN_DEEPSEEK = {**YARN, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}


def test_both_layouts_read_the_same_rope():
    v4 = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    v5 = {"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}
    assert read_rope(v4, 1e4, MAX_POS) == read_rope(v5, 1e4, MAX_POS)
    assert read_rope(v4, 1e4, MAX_POS) == RopeConfig("linear", 5e5, 2.0)


@pytest.mark.parametrize(
    ("arch", "theta"), [("mixtral", 1e6), ("qwen2_moe", 1e4), ("qwen3_moe", 1e4)]
)
def test_each_family_has_its_own_default_theta(arch, theta):
    d = tiny_config(arch)
    del d["rope_theta"]
    assert MoEConfig.from_dict(d).rope == RopeConfig("default", theta)


def test_transformers_5_expert_count_key_is_read():
    d = tiny_config("qwen3_moe")
    d["num_local_experts"] = d.pop("num_experts")
    assert MoEConfig.from_dict(d).num_experts == 16


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 3.0},
        YARN,
        YARN_DEEPSEEK,
        {**YARN, "attention_factor": 1.3, "truncate": False},
    ],
)
def test_inverse_frequencies_equal_transformers(params):
    params = {**params, "rope_theta": 10000.0}
    hf_config = transformers.Qwen3MoeConfig(
        head_dim=HEAD_DIM, max_position_embeddings=MAX_POS, rope_parameters=dict(params)
    )
    want, want_scale = ROPE_INIT_FUNCTIONS.get(params["rope_type"], _hf_default)(hf_config, "cpu")
    rope = read_rope({"rope_parameters": params}, 1e4, MAX_POS)
    got, scale = inv_freq_and_scale(rope, HEAD_DIM)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    assert scale == pytest.approx(want_scale, rel=1e-7)


def _hf_default(config, device):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    return Qwen3MoeRotaryEmbedding.compute_default_rope_parameters(config, device)


@pytest.mark.parametrize(
    ("rope", "match"),
    [
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_type 'longrope'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "alpha": 1}}, "alpha"),
        ({"rope_parameters": {"rope_type": "default", "factor": 2.0}}, "factor"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer"),
    ],
)
def test_unimplemented_rope_is_refused_by_name(rope, match):
    d = {**tiny_config("qwen3_moe"), **rope}
    with pytest.raises(UnsupportedConfigError, match=match):
        MoEConfig.from_dict(d)


def test_scaled_rope_without_factor_is_an_error():
    d = {**tiny_config("qwen3_moe"), "rope_scaling": {"type": "yarn"}}
    with pytest.raises(ValueError, match="yarn rope needs a positive factor"):
        MoEConfig.from_dict(d)
