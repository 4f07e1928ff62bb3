"""Parity with Hugging Face transformers (pinned in the test dependencies; never skipped).

For every supported family (DeepSeek-V3 included: latent attention, grouped sigmoid routing,
shared experts on the attention side), a tiny random model is written in the 4.x config layout
(top-level ``rope_theta``, ``num_experts``, float32, sharded by us) and then loaded by
transformers and saved again with ``save_pretrained`` in bfloat16 over many shards
(transformers 5's layout: ``rope_parameters``, ``dtype``, the Qwen expert count as
``num_local_experts``). Each checkpoint is served by our model in process and with its experts
in two real expert-server processes; the float32 logits of a prompt must be within 1e-4 of
transformers' and the greedy tokens equal to transformers' own ``generate``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os

import pytest
import torch
import transformers
from moecomm import prefork
from moecomm.runtime.control import HttpServer, make_app
from moecomm.runtime.server import ExpertServer
from moecomm.testing import connect_client
from moecomm_serving.engine.generate import generate
from moecomm_serving.model.checkpoint import Checkpoint, save_checkpoint
from moecomm_serving.model.config import MoEConfig
from moecomm_serving.model.tiny import random_tensors, tiny_config
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams

PROMPT_LEN = 20
NEW_TOKENS = 10
ATOL = 1e-4
SEED = 5
# Small shards, so both layouts are read from several files through the index.
OUR_SHARD_BYTES = 4 << 20
HF_SHARD_SIZE = "2MB"
# Deadlines: a server process loading a tiny checkpoint; a server process left waiting for the
# next checkpoint (it exits then, should the test process be gone without a word).
START_S = 120.0
IDLE_S = 600.0
CLIENT_TIMEOUT_S = 20.0
MAX_TOKENS = 64  # per request to the expert servers; a prompt is PROMPT_LEN tokens
LINEAR_ROPE = {"rope_scaling": {"type": "linear", "factor": 2.0}}
# DeepSeek-V3's shape of yarn (mscale / mscale_all_dim), on a 512-token original context.
YARN_ROPE = {
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    }
}

# DeepSeek-V3 without q LoRA (plain q_proj), with attention biases, "rotate half" rope, no top-k
# renormalization, two dense layers and one expert group.
DEEPSEEK_VARIANT = {
    "q_lora_rank": None,
    "attention_bias": True,
    "rope_interleave": False,
    "norm_topk_prob": False,
    "first_k_dense_replace": 2,
    "n_group": 1,
    "topk_group": 1,
}


def _host(conn) -> None:
    """An expert-server process: for each (checkpoint, hosted experts) it is sent, serves those
    experts until told ``done``; ``None`` (or silence for IDLE_S) ends it."""
    torch.set_num_threads(1)
    for n in range(1_000_000):
        if not conn.poll(IDLE_S):
            return
        msg = conn.recv()
        if msg is None:
            return
        ckpt_dir, hosted = msg
        experts = Checkpoint(ckpt_dir).read_experts(hosted, torch.float32)
        server = ExpertServer(experts, f"parity-{os.getpid()}-{n}")
        http = HttpServer(make_app(server))
        server.start()
        conn.send(http.start())
        with contextlib.suppress(EOFError):
            if conn.poll(IDLE_S):
                conn.recv()
        http.stop()
        server.close()


@pytest.fixture(scope="module")
def server_procs():
    """Two expert-server processes, reused by every case of the module."""
    ctx = prefork.process_context()
    procs = []
    try:
        for _ in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_host, args=(child,), daemon=True)
            p.start()
            procs.append((p, parent))
        yield procs
    finally:
        for p, conn in procs:
            with contextlib.suppress(OSError):
                conn.send(None)
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)


@contextlib.contextmanager
def hosting(procs, ckpt_dir, cfg: MoEConfig):
    """The experts of `ckpt_dir` split over the processes (even ids / odd ids): their URLs."""
    sparse = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i)]
    for k, (_, conn) in enumerate(procs):
        hosted = {i: range(k, cfg.num_experts, len(procs)) for i in sparse}
        conn.send((str(ckpt_dir), hosted))
    urls = []
    try:
        for p, conn in procs:
            assert conn.poll(START_S), f"expert server {p.pid} did not start"
            urls.append(conn.recv())
        yield urls
    finally:
        for _, conn in procs:
            with contextlib.suppress(OSError):
                conn.send("done")


def write_v4(path, arch: str, overrides: dict | None) -> None:
    """Our writer, in transformers 4.x's config layout (top-level rope_theta, num_experts)."""
    cfg_dict = tiny_config(arch, overrides)
    assert "rope_theta" in cfg_dict and "rope_parameters" not in cfg_dict
    save_checkpoint(
        path, cfg_dict, random_tensors(MoEConfig.from_dict(cfg_dict), SEED), OUR_SHARD_BYTES
    )


def write_v5(path, v4_dir) -> None:
    """transformers 5's own save_pretrained of the v4 model, in bfloat16 over many shards."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(v4_dir, dtype=torch.bfloat16)
    hf.save_pretrained(path, max_shard_size=HF_SHARD_SIZE)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        saved = json.load(f)
    assert "rope_parameters" in saved and "rope_theta" not in saved, sorted(saved)
    assert saved["dtype"] == "bfloat16"


def hf_reference(ckpt_dir, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = hf(ids).logits[0]
        tokens = hf.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )[0, PROMPT_LEN:].tolist()
    return logits, tokens


def check_model(model, ids: torch.Tensor, logits: torch.Tensor, tokens: list[int]) -> None:
    got = model.forward([ids[0].tolist()], [model.new_sequence()], all_logits=True)
    torch.testing.assert_close(got, logits, atol=ATOL, rtol=0)
    params = SamplingParams(NEW_TOKENS, ignore_eos=True)
    assert generate(model, [ids[0].tolist()], params)[0].tokens == tokens


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("mixtral", None),
        ("qwen2_moe", None),
        ("qwen3_moe", None),
        ("mixtral", LINEAR_ROPE),
        ("qwen3_moe", YARN_ROPE),
        ("mixtral", {"tie_word_embeddings": True}),
        ("qwen3_moe", {"attention_bias": True, "norm_topk_prob": False}),
        ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": []}),
        ("deepseek_v3", None),
        ("deepseek_v3", YARN_ROPE),
        ("deepseek_v3", DEEPSEEK_VARIANT),
    ],
)
@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_logits_and_greedy_tokens_match_transformers(
    tmp_path, server_procs, arch, overrides, layout
):
    v4_dir = tmp_path / "v4"
    write_v4(v4_dir, arch, overrides)
    ckpt_dir = v4_dir
    if layout == "v5":
        ckpt_dir = tmp_path / "v5"
        write_v5(ckpt_dir, v4_dir)
    assert len(glob.glob(str(ckpt_dir / "*.safetensors"))) > 1  # sharded, with an index
    ids = torch.randint(0, 256, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(3))
    logits, tokens = hf_reference(ckpt_dir, ids)

    check_model(load_model(ckpt_dir, dtype=torch.float32), ids, logits, tokens)

    cfg = MoEConfig.from_file(ckpt_dir)
    with hosting(server_procs, ckpt_dir, cfg) as urls:
        client = connect_client(
            urls, cfg.hidden_size, cfg.num_experts_per_tok, MAX_TOKENS, timeout=CLIENT_TIMEOUT_S
        )
        try:
            remote = load_model(ckpt_dir, experts=client, dtype=torch.float32)
            check_model(remote, ids, logits, tokens)
        finally:
            client.close()
