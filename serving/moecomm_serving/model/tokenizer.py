"""Tokenizers: a byte-level one for the tiny model, ``tokenizer.json`` for real checkpoints.

:func:`load_tokenizer` uses the checkpoint's own files when it has them, as transformers does:
``tokenizer.json`` (through the ``tokenizers`` package) with its post-processor deciding whether
a BOS is added (``add_bos_token`` in ``tokenizer_config.json`` overrides it), the special tokens
and chat template of ``tokenizer_config.json`` / ``chat_template.jinja``, and every EOS id of
``generation_config.json`` (else ``config.json``). Without ``tokenizer.json`` it falls back to the
byte-level tokenizer, which is only accepted for a model whose vocabulary is exactly the byte
vocabulary: any other id would be sampled and could not be decoded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Protocol

from moecomm.errors import MoecommError

from moecomm_serving.model.chat_template import ChatTemplateRenderer

NUM_BYTES = 256
# Special ids follow the 256 byte ids: begin, end and padding of a sequence.
BOS_ID, EOS_ID, PAD_ID = NUM_BYTES, NUM_BYTES + 1, NUM_BYTES + 2
BYTE_VOCAB_SIZE = NUM_BYTES + 3
# The special-token names transformers passes to a chat template (its special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class TokenizerError(MoecommError, ValueError):
    """The checkpoint's tokenizer files are missing a piece, malformed, or do not fit the model."""


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    eos_ids: tuple[int, ...]  # every id that ends a generation
    chat_template: ChatTemplateRenderer | None  # the checkpoint's own, when it has one

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Token id = UTF-8 byte value; ids 256..258 are BOS, EOS and PAD."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    eos_ids = (EOS_ID,)
    pad_id = PAD_ID
    vocab_size = BYTE_VOCAB_SIZE
    chat_template = None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; special ids are dropped, broken UTF-8 becomes U+FFFD."""
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} outside the byte vocabulary [0, {self.vocab_size})"
            )
        return bytes(i for i in ids if i < NUM_BYTES).decode("utf-8", errors="replace")


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object file, {} when absent; a malformed one is a :class:`TokenizerError`."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot read it as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def load_eos_ids(path: str | os.PathLike) -> tuple[int, ...]:
    """Every EOS id generation stops on: ``generation_config.json``'s list, as transformers'
    ``generate`` uses it, else ``config.json``'s (which may also be a list)."""
    path = os.fspath(path)
    gen = _read_json(os.path.join(path, "generation_config.json"))
    if "eos_token_id" in gen:
        return tuple(_id_list(gen["eos_token_id"]))
    cfg = _read_json(os.path.join(path, "config.json"))
    return tuple(_id_list(cfg.get("eos_token_id")))


def load_chat_template(path: str | os.PathLike, tok_config: dict) -> str | None:
    """The checkpoint's chat template source: ``chat_template.jinja`` (transformers 5 writes it
    there) or ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of named
    templates of which ``default`` is used)."""
    path = os.fspath(path)
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    tpl = tok_config.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if tpl is not None and not isinstance(tpl, str):
        raise TokenizerError(f"{path}: chat_template must be a string, got {type(tpl).__name__}")
    return tpl


class HFTokenizer:
    """A checkpoint's ``tokenizer.json`` through the ``tokenizers`` package, with the special
    tokens and chat template of its ``tokenizer_config.json``."""

    def __init__(self, path: str | os.PathLike, config=None):
        from tokenizers import Tokenizer as _Tok

        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        try:
            self._tok = _Tok.from_file(tj)
        except Exception as exc:  # the Rust side raises its own exception type
            raise TokenizerError(f"{tj}: not a valid tokenizer.json: {exc}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        tok_config = _read_json(os.path.join(path, "tokenizer_config.json"))
        self.special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(tok_config.get(name))) is not None
        }
        self.bos_id = self._special_id("bos_token", getattr(config, "bos_token_id", None))
        self.eos_id = self._special_id("eos_token", getattr(config, "eos_token_id", None))
        self.eos_ids = load_eos_ids(path) or ((self.eos_id,) if self.eos_id is not None else ())
        # None: the post-processor of tokenizer.json decides, as for any fast tokenizer
        self.add_bos_token: bool | None = tok_config.get("add_bos_token")
        source = load_chat_template(path, tok_config)
        self.chat_template = None
        if source is not None:
            self.chat_template = ChatTemplateRenderer(source, self.special_tokens)

    def _special_id(self, name: str, fallback: int | None) -> int | None:
        text = self.special_tokens.get(name)
        if text is None:
            return fallback
        tid = self._tok.token_to_id(text)
        if tid is None:
            raise TokenizerError(f"tokenizer_config.json: {name} {text!r} is not in tokenizer.json")
        return tid

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """`add_bos`: apply the checkpoint's special-token rules (a BOS only where its
        post-processor or ``add_bos_token`` adds one); False for text that already carries its
        special tokens, such as a rendered chat template."""
        # encode_batch releases the GIL while it works, encode holds it: a long prompt tokenized
        # off the event loop must not stall the loop and the engine thread for seconds.
        ids = self._tok.encode_batch([text], add_special_tokens=add_bos)[0].ids
        if not add_bos or self.add_bos_token is None or self.bos_id is None:
            return ids
        has_bos = bool(ids) and ids[0] == self.bos_id
        if self.add_bos_token and not has_bos:
            return [self.bos_id, *ids]
        if not self.add_bos_token and has_bos:
            return ids[1:]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def check_fits_model(tok, vocab_size: int, where: str) -> None:
    """Refuses a tokenizer that cannot decode every id the model can sample (the byte tokenizer
    for a larger vocabulary) or that produces ids the model has no embedding for."""
    tok_vocab = getattr(tok, "vocab_size", None)
    if isinstance(tok, ByteTokenizer) and vocab_size != BYTE_VOCAB_SIZE:
        raise TokenizerError(
            f"{where} has no tokenizer.json, and the byte-level fallback decodes exactly "
            f"{BYTE_VOCAB_SIZE} ids but the model's vocab_size is {vocab_size}; add the "
            "checkpoint's tokenizer.json"
        )
    if tok_vocab is not None and tok_vocab > vocab_size:
        raise TokenizerError(
            f"{where}: the tokenizer has {tok_vocab} ids but the model's vocab_size is "
            f"{vocab_size}; the tokenizer does not belong to this model"
        )


def load_tokenizer(path: str | os.PathLike, config=None) -> Tokenizer:
    """The tokenizer of a checkpoint directory, checked against ``config.vocab_size``.

    ``tokenizer.json`` wins when present; otherwise the byte-level tokenizer, which needs a
    vocabulary of exactly :data:`BYTE_VOCAB_SIZE` ids. Raises :class:`TokenizerError`.
    """
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        tok: Tokenizer = HFTokenizer(path, config)
    else:
        tok = ByteTokenizer()
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None:
        check_fits_model(tok, vocab, path)
    return tok
