"""Checkpoint round trip, strict HF-name loading with clear errors, partial loading, configs."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from moecomm_serving.model.checkpoint import Checkpoint, CheckpointError, expected_tensors
from moecomm_serving.model.config import MoEConfig, UnsupportedConfigError
from moecomm_serving.model.tiny import random_tensors, tiny_config
from moecomm_serving.model.transformer import load_model
from safetensors.torch import load_file, save_file


def test_tiny_round_trip(mixtral_dir):
    cfg = MoEConfig.from_file(mixtral_dir)
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (4, 16, 2)
    assert cfg.hidden_size == 256 and cfg.num_kv_groups == 4
    shards = sorted(f for f in os.listdir(mixtral_dir) if f.endswith(".safetensors"))
    assert len(shards) > 1 and os.path.exists(mixtral_dir / "model.safetensors.index.json")
    written = random_tensors(cfg, seed=0)
    ckpt = Checkpoint(mixtral_dir)
    loaded = ckpt.read(written)
    assert set(loaded) == set(written) == set(expected_tensors(cfg))
    for name, t in written.items():
        assert torch.equal(loaded[name], t), name
    assert "model.layers.3.block_sparse_moe.experts.15.w2.weight" in loaded


def test_qwen_layout_loads(qwen_dir, qwen):
    cfg = qwen.config
    assert cfg.model_type == "qwen2_moe" and cfg.attention_bias and not cfg.norm_topk_prob
    assert cfg.sparse_layers == (0, 2, 3) and cfg.shared_expert_intermediate_size == 128
    names = Checkpoint(qwen_dir).files
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer
    assert "model.layers.0.self_attn.q_proj.bias" in names


def copy_ckpt(src, dst, edit):
    """A single-file copy of a checkpoint with its tensors passed through `edit`."""
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_missing_tensor_is_named(mixtral_dir, tmp_path):
    name = "model.layers.2.block_sparse_moe.experts.5.w3.weight"
    bad = copy_ckpt(mixtral_dir, tmp_path / "c", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor {name}"):
        Checkpoint(bad)


def test_wrong_shape_is_named(mixtral_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"

    def edit(t):
        t[name] = torch.zeros(128, 256)

    bad = copy_ckpt(mixtral_dir, tmp_path / "c", edit)
    with pytest.raises(
        CheckpointError, match=rf"{name} has shape \[128, 256\], expected \[64, 256\]"
    ):
        Checkpoint(bad)


def test_unexpected_tensor_is_named(mixtral_dir, tmp_path):
    name = "model.layers.0.block_sparse_moe.experts.16.w1.weight"

    def edit(t):
        t[name] = torch.zeros(128, 256)

    bad = copy_ckpt(mixtral_dir, tmp_path / "c", edit)
    with pytest.raises(CheckpointError, match=f"unexpected tensor {name}"):
        Checkpoint(bad)


def test_rotary_buffers_are_ignored(mixtral_dir, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)

    Checkpoint(copy_ckpt(mixtral_dir, tmp_path / "c", edit))


def test_index_must_agree(mixtral_dir, tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(mixtral_dir, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    index["weight_map"][name] = "elsewhere.safetensors"
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"tensor {name} is listed in 'elsewhere"):
        Checkpoint(dst)


def test_no_weights_or_no_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        Checkpoint(tmp_path / "absent", MoEConfig.from_dict(tiny_config()))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        Checkpoint(tmp_path, MoEConfig.from_dict(tiny_config()))


def test_expert_server_loads_only_its_experts(mixtral_dir):
    ckpt = Checkpoint(mixtral_dir)
    full = random_tensors(ckpt.config, seed=0)
    hosted = ckpt.read_experts({0: [3, 9], 2: [0]})
    assert {k: sorted(v) for k, v in hosted.items()} == {0: [3, 9], 2: [0]}
    w = hosted[0][9]
    assert torch.equal(w.w1, full["model.layers.0.block_sparse_moe.experts.9.w1.weight"])
    assert torch.equal(w.w3, full["model.layers.0.block_sparse_moe.experts.9.w3.weight"])
    assert torch.equal(w.w2, full["model.layers.0.block_sparse_moe.experts.9.w2.weight"])
    with pytest.raises(CheckpointError, match="expert 16 outside"):
        ckpt.read_experts({1: [16]})


def test_dense_layer_has_no_experts(qwen_dir):
    with pytest.raises(CheckpointError, match="layer 1 is not a MoE layer"):
        Checkpoint(qwen_dir).read_experts({1: [0]})


def test_stage_loads_its_layers_only(mixtral_dir):
    stage = load_model(mixtral_dir, layers=range(1, 3))
    assert [b.layer for b in stage.blocks] == [1, 2] and stage.block(2).layer == 2
    with pytest.raises(KeyError, match="layer 0 is not in"):
        stage.block(0)
    assert not stage.has_embed and not stage.has_head
    assert sorted(stage.experts.layers) == [1, 2]
    remote = load_model(mixtral_dir, experts=_NoExperts(), layers=range(3, 4))
    assert remote.has_head and remote.embed_tokens is None


class _NoExperts:
    def dispatch(self, *a):
        raise AssertionError("not called")

    def combine(self, h):
        raise AssertionError("not called")


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("model_type", "llama", "model_type 'llama' is not supported"),
        ("hidden_act", "gelu", "hidden_act 'gelu'"),
        ("rope_scaling", {"type": "llama3", "factor": 8.0}, "rope_type 'llama3'"),
        ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic'"),
        ("rope_scaling", {"type": "linear", "factor": 2.0, "low_freq_factor": 1}, "low_freq"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
        ("layer_types", ["full_attention", "sliding_attention"], "sliding_attention"),
        ("sliding_window", 16, "sliding_window=16"),
        ("quantization_config", {"quant_method": "gptq"}, "quantized"),
    ],
)
def test_unsupported_config_is_named(key, value, match):
    d = tiny_config("mixtral")
    d[key] = value
    with pytest.raises(UnsupportedConfigError, match=match):
        MoEConfig.from_dict(d)


def test_bad_config_values():
    d = tiny_config("mixtral")
    del d["num_local_experts"]
    with pytest.raises(ValueError, match="'num_local_experts' is missing"):
        MoEConfig.from_dict(d)
    d = tiny_config("mixtral")
    d["num_key_value_heads"] = 3
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        MoEConfig.from_dict(d)
    d = tiny_config("qwen2_moe")
    d["use_sliding_window"] = True
    with pytest.raises(UnsupportedConfigError, match="use_sliding_window"):
        MoEConfig.from_dict(d)


def test_integer_tensor_is_rejected(mixtral_dir, tmp_path):
    name = "model.norm.weight"

    def edit(t):
        t[name] = torch.ones(256, dtype=torch.int32)

    bad = copy_ckpt(mixtral_dir, tmp_path / "c", edit)
    with pytest.raises(CheckpointError, match=f"{name} has dtype I32"):
        Checkpoint(bad)


def test_bfloat16_checkpoint_loads_and_casts(tmp_path):
    from moecomm_serving.model.tiny import write_tiny

    write_tiny(str(tmp_path), "mixtral", seed=0, dtype=torch.bfloat16)
    ckpt = Checkpoint(tmp_path)
    assert ckpt.config.torch_dtype == "bfloat16"
    t = ckpt.read(["model.norm.weight"])["model.norm.weight"]
    assert t.dtype == torch.bfloat16
    assert ckpt.read(["model.norm.weight"], torch.float32)["model.norm.weight"].dtype == (
        torch.float32
    )
    m = load_model(tmp_path, dtype=torch.float32)
    assert m.dtype == torch.float32 and m.experts.layers[0].dtype == torch.float32
