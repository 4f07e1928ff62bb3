"""Parity with Hugging Face transformers' own Mixtral / Qwen2-MoE, when transformers is
installed (it is not a dependency; CI skips this). Run it with, e.g.,
``pip install --target /tmp/hf --no-deps transformers==4.57.6 "huggingface_hub<1" tokenizers
regex pyyaml tqdm requests urllib3 idna charset_normalizer certifi`` and
``PYTHONPATH=/tmp/hf pytest tests/serving/test_hf_parity.py``."""

from __future__ import annotations

import pytest
import torch
from moecomm_serving.generate import SamplingParams, generate
from moecomm_serving.model import load_model
from moecomm_serving.tiny import write_tiny

transformers = pytest.importorskip("transformers")

PROMPT_LEN = 20
NEW_TOKENS = 10


@pytest.mark.parametrize(
    ("layout", "overrides"),
    [("mixtral", None), ("qwen2_moe", None), ("mixtral", {"tie_word_embeddings": True})],
)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, layout, overrides):
    write_tiny(str(tmp_path), layout, seed=5, overrides=overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ours = load_model(tmp_path)
    ids = torch.randint(0, 256, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        ref_tokens = hf.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )[0, PROMPT_LEN:].tolist()
    got = ours.forward([ids[0].tolist()], [ours.new_sequence()], all_logits=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    params = SamplingParams(NEW_TOKENS, ignore_eos=True)
    assert generate(ours, [ids[0].tolist()], params)[0].tokens == ref_tokens
