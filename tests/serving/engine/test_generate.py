"""Batched generation equals one-by-one generation; sampling is seeded; the tokenizers."""

from __future__ import annotations

import pytest
import torch
from moecomm_serving.engine.generate import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    generate,
    make_generator,
    sample_next,
    step,
)
from moecomm_serving.model.tokenizer import ByteTokenizer, load_tokenizer
from moecomm_serving.types import SamplingParams

TOK = ByteTokenizer()
TEXTS = ["Hello", "Mixture of experts, disaggregated.", "a", "Ünïcödé ✓ and more text"]


def prompts():
    return [TOK.encode(t) for t in TEXTS]


def test_batched_greedy_equals_one_by_one(model):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    batched = generate(model, prompts(), params)
    for p, b in zip(prompts(), batched, strict=True):
        (alone,) = generate(model, [p], params)
        assert b.tokens == alone.tokens
        assert len(b.tokens) == 12 and b.finish_reason == FINISH_LENGTH
    # the random model does not just repeat one token: the comparison has content
    assert len({tuple(g.tokens) for g in batched}) == len(TEXTS)
    assert len({t for g in batched for t in g.tokens}) > 12


def test_greedy_equals_argmax_of_full_forward(mixtral):
    p = TOK.encode("check")
    (g,) = generate(mixtral, [p], SamplingParams(max_new_tokens=4, ignore_eos=True))
    seq = list(p)
    for tok in g.tokens:
        logits = mixtral.forward([seq], [mixtral.new_sequence()])[0]
        assert int(torch.argmax(logits)) == tok
        seq.append(tok)


def test_sampling_is_seeded_and_batch_independent(mixtral):
    per = [
        SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True)
        for s in range(len(TEXTS))
    ]
    batched = generate(mixtral, prompts(), per)
    again = generate(mixtral, prompts(), per)
    assert [g.tokens for g in batched] == [g.tokens for g in again]
    for p, sp, b in zip(prompts(), per, batched, strict=True):
        assert generate(mixtral, [p], sp)[0].tokens == b.tokens
    other_seed = generate(mixtral, prompts()[:1], [SamplingParams(10, 1.0, 0.9, seed=77)])
    greedy = generate(mixtral, prompts()[:1], SamplingParams(10, ignore_eos=True))
    assert batched[0].tokens not in (other_seed[0].tokens, greedy[0].tokens)


def test_sample_next_rules():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert sample_next(logits, SamplingParams(), None) == 1
    # top_p small enough keeps only the most likely token, whatever the generator draws
    tiny_p = SamplingParams(temperature=5.0, top_p=0.01, seed=0)
    g = make_generator(tiny_p)
    assert {sample_next(logits, tiny_p, g) for _ in range(50)} == {1}
    # top_p = 0.6 keeps tokens 1 and 2 (mass before token 2 is ~0.49 < 0.6), never 0 or 3
    p = SamplingParams(temperature=1.0, top_p=0.6, seed=1)
    g = make_generator(p)
    assert {sample_next(logits, p, g) for _ in range(200)} == {1, 2}
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_stop_tokens_end_a_sequence_only(mixtral):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    free = generate(mixtral, prompts()[:2], params)
    stop_at = free[0].tokens[2]
    first = free[0].tokens.index(stop_at)
    stopped = generate(
        mixtral, prompts()[:2], [SamplingParams(8, stop_token_ids=(stop_at,)), params]
    )
    assert stopped[0].tokens == free[0].tokens[: first + 1]
    assert stopped[0].finish_reason == FINISH_STOP
    assert stopped[1].tokens == free[1].tokens  # the other sequence went on
    eos = generate(mixtral, prompts()[:1], SamplingParams(8), eos_token_id=stop_at)
    assert eos[0].tokens == stopped[0].tokens


def test_generate_rejects_bad_requests(mixtral):
    assert generate(mixtral, []) == []
    with pytest.raises(ValueError, match="at least one token"):
        generate(mixtral, [[1], []])
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        generate(mixtral, [[1], [2]], [SamplingParams()])


def test_byte_tokenizer_round_trip(mixtral_dir, mixtral):
    tok = load_tokenizer(mixtral_dir, mixtral.config)
    assert isinstance(tok, ByteTokenizer)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id == mixtral.config.bos_token_id
        assert all(0 <= i < 256 for i in ids[1:])
        assert tok.decode([*ids, tok.eos_id]) == text
    assert tok.decode([0xC3]) == "\ufffd"  # a cut UTF-8 sequence does not raise
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tok.decode([300])


def test_tokenizer_json_needs_the_package(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="optional 'tokenizers' package"):
            load_tokenizer(tmp_path)
    else:
        with pytest.raises(Exception):  # noqa: B017 - "{}" is not a valid tokenizer.json
            load_tokenizer(tmp_path)


def test_command_line(mixtral_dir, capsys):
    from moecomm_serving.engine.generate import main

    main(
        [
            "--model",
            str(mixtral_dir),
            "--prompt",
            "hi",
            "--prompt",
            "there",
            "--max-new-tokens",
            "3",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("'hi' -> ") and "3 tokens, length" in lines[0]


def test_continuous_batching_joins_and_leaves(mixtral):
    """Requests joining mid-way (prefill mixed with decode) and leaving early keep their tokens."""
    params = [SamplingParams(n, ignore_eos=True) for n in (9, 3, 6)]
    alone = [generate(mixtral, [p], sp)[0].tokens for p, sp in zip(prompts(), params, strict=False)]
    gens = [Generation(mixtral, p, sp) for p, sp in zip(prompts(), params, strict=False)]
    active = [gens[0]]
    for t in range(12):
        if t == 2:
            active.append(gens[1])  # joins while gens[0] decodes
        if t == 4:
            active.append(gens[2])
        if not active:
            break
        step(mixtral, active)
        active = [g for g in active if not g.finished]
    assert [g.tokens for g in gens] == alone
    assert all(g.finished for g in gens)
    with pytest.raises(RuntimeError, match="finished"):
        gens[1].feed()
