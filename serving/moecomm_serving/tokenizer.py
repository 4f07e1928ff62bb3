"""Tokenizers: a byte-level one for the tiny model, ``tokenizer.json`` for real checkpoints.

:func:`load_tokenizer` uses ``tokenizer.json`` when the checkpoint has one (through the optional
``tokenizers`` package), and the byte-level tokenizer otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

NUM_BYTES = 256
# Special ids follow the 256 byte ids: begin, end and padding of a sequence.
BOS_ID, EOS_ID, PAD_ID = NUM_BYTES, NUM_BYTES + 1, NUM_BYTES + 2
BYTE_VOCAB_SIZE = NUM_BYTES + 3


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Token id = UTF-8 byte value; ids 256..258 are BOS, EOS and PAD."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID
    vocab_size = BYTE_VOCAB_SIZE

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


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(self, path: str, bos_id: int | None, eos_id: int | None):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError:
            raise ImportError(
                f"{path} needs the optional 'tokenizers' package (pip install tokenizers)"
            ) from None
        self._tok = _Tok.from_file(path)
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(path: str | os.PathLike, config=None) -> Tokenizer:
    """The tokenizer of a checkpoint directory.

    ``tokenizer.json`` wins when present; otherwise the byte-level tokenizer, which needs a
    vocabulary of at least :data:`BYTE_VOCAB_SIZE` ids.
    """
    path = os.fspath(path)
    tj = os.path.join(path, "tokenizer.json")
    if os.path.exists(tj):
        return HFTokenizer(
            tj, getattr(config, "bos_token_id", None), getattr(config, "eos_token_id", None)
        )
    vocab = getattr(config, "vocab_size", BYTE_VOCAB_SIZE)
    if vocab < BYTE_VOCAB_SIZE:
        raise ValueError(
            f"{path} has no tokenizer.json and its vocab_size {vocab} is too small for the "
            f"byte-level tokenizer ({BYTE_VOCAB_SIZE} ids)"
        )
    return ByteTokenizer()
