"""Tokenizer files of a checkpoint as transformers saves them, for the tiny model's 259 ids.

A byte-level BPE without merges maps each byte to one id (the 256 ids of the byte-level
alphabet), then three special tokens: ``<s>`` 256, ``</s>`` 257, ``<|im_end|>`` 258. A text's
token count is therefore its UTF-8 length, which makes expected prompts easy to compute.
"""

from __future__ import annotations

import json
import os
import shutil

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

BOS, EOS, IM_END = "<s>", "</s>", "<|im_end|>"
BOS_ID, EOS_ID, IM_END_ID = 256, 257, 258
# A ChatML template with a system default and a check, like Qwen's: no BOS, raise_exception on
# a conversation that does not end with a user turn.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if messages[-1]['role'] != 'user' %}"
    "{{ raise_exception('the last message must be the user\\'s') }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A Llama-style template that writes the BOS itself.
LLAMA_STYLE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] | trim }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
)


def byte_tokenizer(add_bos: bool) -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, IM_END])
    if add_bos:  # the post-processor is where a tokenizer.json says "add a BOS"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)]
        )
    return tok


def write_checkpoint(
    out,
    weights_dir,
    *,
    add_bos: bool,
    chat_template: str | None,
    template_file: bool = False,
    eos_ids: list[int] | None = None,
) -> str:
    """A copy of the tiny checkpoint in `weights_dir` with tokenizer files; returns its path.

    `template_file`: write the template to ``chat_template.jinja`` (transformers 5) rather than
    into ``tokenizer_config.json`` (4.x). `eos_ids`: ``generation_config.json``'s list.
    """
    out = os.fspath(out)
    shutil.copytree(weights_dir, out)
    byte_tokenizer(add_bos).save(os.path.join(out, "tokenizer.json"))
    config = {
        "bos_token": BOS,
        "eos_token": {"__type": "AddedToken", "content": EOS, "special": True},
    }
    if chat_template is not None and template_file:
        with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(chat_template)
    elif chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    if eos_ids is not None:
        with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": eos_ids}, f)
    return out


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """The ids of `text` without special tokens (one per UTF-8 byte)."""
    return tok.encode(text, add_special_tokens=False).ids
