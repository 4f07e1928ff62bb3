"""A tiny random checkpoint in HF layout, for the demo and the tests (nothing is downloaded).

``python -m moecomm_serving.model.tiny --out DIR [--arch mixtral|qwen2_moe|qwen3_moe|deepseek_v3]``
(``--layout`` is an older name of ``--arch``).

The weights are random but deterministic (one generator, tensors drawn in sorted-name order),
scaled so activations keep unit size through the layers and the logits of different tokens are
well apart: greedy decoding of the tiny model is then stable under float rounding, which the
token-for-token comparisons (batched vs. one-by-one, disaggregated vs. monolithic) rely on.
"""

from __future__ import annotations

import argparse
import re

import torch

from moecomm_serving.model.checkpoint import expected_tensors, save_checkpoint
from moecomm_serving.model.config import DEEPSEEK_V3, MIXTRAL, QWEN2_MOE, QWEN3_MOE, MoEConfig
from moecomm_serving.model.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer

DEFAULT_SEED = 0
# Small enough that the whole test directory stays fast on two shared cores, large enough to
# have real GQA (8 query heads over 2 KV heads) and routing choices (top-2 of 16).
TINY_MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": MIXTRAL,
    "vocab_size": BYTE_VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_local_experts": 16,
    "num_experts_per_tok": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
# The same size in the Qwen2-MoE layout, using what Mixtral lacks: q/k/v biases, a shared
# expert, no top-k renormalization and a dense layer (mlp_only_layers). Embeddings stay untied:
# a tied random model mostly repeats its last token, which makes generation tests weak
# (tied embeddings are tested with an override).
TINY_QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": QWEN2_MOE,
    "vocab_size": BYTE_VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
# Qwen3-MoE: per-head q/k norms, no shared expert, renormalized top-k and a dense layer; the
# q/k/v/o biases (attention_bias) are tested with an override.
TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": QWEN3_MOE,
    "vocab_size": BYTE_VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [2],
    "attention_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
# DeepSeek-V3 in miniature: latent attention with q and kv LoRA and small decoupled rope heads,
# one dense first layer, a shared expert, 16 routed experts in 4 groups (2 eligible), top-4,
# sigmoid scores scaled by routed_scaling_factor. 4.x layout (rope_theta, n_routed_experts).
TINY_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": DEEPSEEK_V3,
    "vocab_size": BYTE_VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "rope_interleave": True,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0,
    "attention_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
LAYOUTS = {
    MIXTRAL: TINY_MIXTRAL,
    QWEN2_MOE: TINY_QWEN2_MOE,
    QWEN3_MOE: TINY_QWEN3_MOE,
    DEEPSEEK_V3: TINY_DEEPSEEK_V3,
}
ARCHS = tuple(sorted(LAYOUTS))
# Shards of at most this many bytes, so the tiny checkpoint exercises multi-file loading and
# the index file like a real one.
SHARD_BYTES = 16 << 20
# Router logits this large (std) make the top-k choice decisive: a near-tie between experts
# would let float rounding change the route of a token between batched and single runs.
ROUTER_STD = 4.0
NORM_STD = 0.1  # RMSNorm weights 1 ± this: not all ones, so a wrong norm shows
BIAS_STD = 0.1
CORRECTION_BIAS_STD = 0.1


def tiny_config(layout: str = MIXTRAL, overrides: dict | None = None) -> dict:
    """The config dict of a tiny model; `overrides` replaces keys (tests of other variants)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    tok = ByteTokenizer()
    return {
        **LAYOUTS[layout],
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        **(overrides or {}),
    }


def random_tensors(
    config: MoEConfig, seed: int = DEFAULT_SEED, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Deterministic random weights for every tensor the config implies."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(expected_tensors(config).items()):
        if name.endswith("norm.weight"):
            t = 1.0 + NORM_STD * torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            # Sigmoid scores are in (0, 1): a bias of this size moves some choices, not all.
            t = CORRECTION_BIAS_STD * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = BIAS_STD * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            # Unit-size rows, like a normed hidden state. Tied, the rows are also the LM head:
            # smaller ones keep a token's own row from dominating its logits (the model would
            # just repeat its input), and keep logits at the untied head's scale.
            std = shape[1] ** -0.5 if config.tie_word_embeddings else 1.0
            t = std * torch.randn(shape, generator=g)
        elif re.search(r"\.gate\.weight$", name):
            t = ROUTER_STD * torch.randn(shape, generator=g) * shape[1] ** -0.5
        else:  # projections [out, in]: 1/sqrt(in) keeps each output at unit size
            t = torch.randn(shape, generator=g) * shape[1] ** -0.5
        out[name] = t.to(dtype)
    return out


def write_tiny(
    out: str,
    layout: str = MIXTRAL,
    seed: int = DEFAULT_SEED,
    dtype: torch.dtype = torch.float32,
    overrides: dict | None = None,
) -> MoEConfig:
    """Writes ``config.json`` and the sharded safetensors of a tiny random model to `out`."""
    cfg_dict = tiny_config(layout, overrides)
    cfg_dict["torch_dtype"] = str(dtype).removeprefix("torch.")
    config = MoEConfig.from_dict(cfg_dict)
    save_checkpoint(out, cfg_dict, random_tensors(config, seed, dtype), SHARD_BYTES)
    return config


def add_arch_argument(p: argparse.ArgumentParser, help: str = "model family") -> None:
    """--arch (older name --layout): the model family of a tiny checkpoint (`moecomm tiny`,
    `moecomm demo`)."""
    p.add_argument(
        "--arch",
        "--layout",
        dest="arch",
        default=MIXTRAL,
        choices=ARCHS,
        help=f"{help} (--layout is its older name)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `moecomm tiny` (and ``python -m moecomm_serving.model.tiny``), read by
    :func:`run`."""
    p.add_argument("--out", required=True, help="directory to write")
    add_arch_argument(p)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the random weights")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def run(args: argparse.Namespace) -> int:
    config = write_tiny(args.out, args.arch, args.seed, getattr(torch, args.dtype))
    print(
        f"wrote a tiny {config.model_type} checkpoint to {args.out}: {config.num_hidden_layers} "
        f"layers, {config.num_experts} experts, top-{config.num_experts_per_tok}, "
        f"hidden {config.hidden_size}"
    )
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
