"""The checkpoint's own tokenizer: its BOS rule, its chat template (rendered as transformers
renders it) for /v1/chat/completions, every EOS id of its generation config; and tokenizers that
do not fit the model refused at start-up."""

from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest
from frontend_helpers import MODEL_NAME
from moecomm_serving.engine.generate import generate
from moecomm_serving.model.config import MoEConfig
from moecomm_serving.model.tiny import write_tiny
from moecomm_serving.model.tokenizer import BYTE_VOCAB_SIZE, TokenizerError, load_tokenizer
from moecomm_serving.types import SamplingParams
from tokenizer_files import (
    BOS_ID,
    CHATML,
    EOS_ID,
    IM_END_ID,
    LLAMA_STYLE,
    byte_ids,
    byte_tokenizer,
    write_checkpoint,
)
from transformers import AutoTokenizer

TIMEOUT_S = 60.0
CONVERSATION = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": " ok "},
    {"role": "user", "content": "more"},
]


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory, tiny_dir):
    path = tmp_path_factory.mktemp("ckpt") / "chatml"
    return write_checkpoint(path, tiny_dir, add_bos=False, chat_template=CHATML)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_dir):
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    return write_checkpoint(
        path, tiny_dir, add_bos=True, chat_template=LLAMA_STYLE, template_file=True
    )


def test_bos_follows_the_tokenizer_json_post_processor(chatml_dir, llama_dir, model):
    plain = byte_ids(byte_tokenizer(False), "héllo")
    assert len(plain) == len("héllo".encode())
    assert load_tokenizer(chatml_dir, model.config).encode("héllo") == plain
    assert load_tokenizer(llama_dir, model.config).encode("héllo") == [BOS_ID, *plain]
    tok = load_tokenizer(llama_dir, model.config)
    assert tok.decode([BOS_ID, *plain, EOS_ID]) == "héllo"  # special tokens are dropped


def test_chat_template_renders_like_transformers(chatml_dir, llama_dir, model):
    chatml = load_tokenizer(chatml_dir, model.config).chat_template
    assert chatml.render(CONVERSATION) == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n ok <|im_end|>\n"
        "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )
    # from chat_template.jinja, with bos_token / eos_token bound from tokenizer_config.json
    llama = load_tokenizer(llama_dir, model.config).chat_template
    assert llama.render(CONVERSATION) == "<s>[USER] hi[ASSISTANT] ok</s>[USER] more"  # trim_blocks


@pytest.mark.parametrize("layout", ["chatml", "llama"])
def test_prompt_ids_equal_transformers_apply_chat_template(layout, chatml_dir, llama_dir, model):
    path = chatml_dir if layout == "chatml" else llama_dir
    reference = AutoTokenizer.from_pretrained(path)
    ours = load_tokenizer(path, model.config)
    text = ours.chat_template.render(CONVERSATION)
    assert text == reference.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    expected = reference.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=True
    )
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ours.encode(text, add_bos=False) == list(expected)
    assert ours.encode("héllo") == reference("héllo")["input_ids"]  # the BOS rule


def test_chat_completion_uses_the_checkpoint_template(serve, chatml_dir, model):
    tok = load_tokenizer(chatml_dir, model.config)
    served = serve(model, tokenizer=tok)
    r = client(served).chat.completions.create(
        model=MODEL_NAME, messages=CONVERSATION, max_tokens=2, temperature=0
    )
    rendered = tok.chat_template.render(CONVERSATION)
    # no BOS: the template has none; <|im_end|> is one special id, not its bytes
    expected = byte_ids(byte_tokenizer(False), rendered)
    assert expected.count(IM_END_ID) == 4 and BOS_ID not in expected
    assert r.usage.prompt_tokens == len(expected)


def test_template_refusal_is_400_and_the_server_keeps_serving(serve, chatml_dir, model):
    served = serve(model, tokenizer=load_tokenizer(chatml_dir, model.config))
    c = client(served)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION[:2], max_tokens=1)
    assert "the last message must be the user's" in str(err.value)
    r = c.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION, max_tokens=1)
    assert r.choices[0].finish_reason == "length"


def test_generation_stops_on_every_eos_id_of_the_generation_config(
    serve, tmp_path, tiny_dir, model
):
    prompt = list(b"The experts")
    (free,) = generate(model, [prompt], SamplingParams(8, temperature=0.0, ignore_eos=True))
    second_eos = free.tokens[2]  # the greedy third token becomes the checkpoint's second EOS
    first_eos = next(t for t in (EOS_ID, IM_END_ID) if t not in free.tokens[:3])
    path = write_checkpoint(
        tmp_path / "eos",
        tiny_dir,
        add_bos=False,
        chat_template=None,
        eos_ids=[first_eos, second_eos],
    )
    tok = load_tokenizer(path, model.config)
    assert tok.eos_ids == (first_eos, second_eos)
    served = serve(model, tokenizer=tok)
    r = client(served).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 3


def test_byte_tokenizer_is_refused_for_another_vocabulary(tmp_path):
    write_tiny(str(tmp_path), overrides={"vocab_size": BYTE_VOCAB_SIZE + 41})
    config = MoEConfig.from_file(tmp_path)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path, config)


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(chatml_dir):
    small = SimpleNamespace(vocab_size=200, bos_token_id=None, eos_token_id=None)
    with pytest.raises(TokenizerError, match="259 ids"):
        load_tokenizer(chatml_dir, small)


def test_malformed_tokenizer_files_are_refused(tmp_path, tiny_dir, model):
    path = write_checkpoint(tmp_path / "bad", tiny_dir, add_bos=False, chat_template="{% if %}")
    with pytest.raises(ValueError, match="does not compile"):
        load_tokenizer(path, model.config)
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load_tokenizer(path, model.config)
