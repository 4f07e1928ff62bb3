"""The slot wire format from Python: encodings, signal words, slot layouts.

The single source of truth is csrc/protocol/; this module only adds the torch dtype of each
encoding and a friendly `SlotLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecomm import _C
from moecomm._C import (
    HEADER_OFFSET,
    MAX_SEQ,
    PAYLOAD_OFFSET,
    SCALE_BLOCK,
    Encoding,
    Expectation,
    MessageKind,
    ResponseStatus,
    SlotConfig,
    SlotHeader,
    SlotState,
    ValidateCode,
    make_signal,
    signal_seq,
    signal_state,
    validate_header,
    validate_reason,
)

# The protocol's names from csrc/protocol/ (through the bindings), and what this module adds.
__all__ = [
    "DTYPE_OF_CODE",
    "ENCODING_DTYPE",
    "ENCODING_OF_CODE",
    "ENCODING_OF_DTYPE",
    "HEADER_OFFSET",
    "MAX_SEQ",
    "PAYLOAD_OFFSET",
    "QUANTIZED_CODES",
    "SCALE_BLOCK",
    "Encoding",
    "Expectation",
    "MessageKind",
    "ResponseStatus",
    "SlotConfig",
    "SlotHeader",
    "SlotLayout",
    "SlotState",
    "ValidateCode",
    "as_encoding",
    "make_signal",
    "scales_per_token",
    "signal_seq",
    "signal_state",
    "validate_header",
    "validate_reason",
]

ENCODING_DTYPE: dict = {
    Encoding.BF16: torch.bfloat16,
    Encoding.FP16: torch.float16,
    Encoding.F32: torch.float32,
    Encoding.INT8: torch.int8,
    Encoding.FP8_E4M3: torch.float8_e4m3fn,
    Encoding.FP8_E4M3_B128: torch.float8_e4m3fn,
}

_NAMES = {
    "bf16": Encoding.BF16,
    "bfloat16": Encoding.BF16,
    "fp16": Encoding.FP16,
    "float16": Encoding.FP16,
    "f32": Encoding.F32,
    "fp32": Encoding.F32,
    "float32": Encoding.F32,
    "int8": Encoding.INT8,
    "fp8": Encoding.FP8_E4M3,
    "fp8_e4m3": Encoding.FP8_E4M3,
    "fp8_e4m3_b128": Encoding.FP8_E4M3_B128,
}
# The encoding of each unquantized dtype: what a tensor of that dtype travels as.
ENCODING_OF_DTYPE: dict = {
    torch.bfloat16: Encoding.BF16,
    torch.float16: Encoding.FP16,
    torch.float32: Encoding.F32,
}
# By the integer code a header carries (`SlotHeader.encoding`): a dict lookup by int is the
# cheapest way from a header to a dtype on the serving loop's hot path.
DTYPE_OF_CODE: dict = {int(e): d for e, d in ENCODING_DTYPE.items()}
ENCODING_OF_CODE: dict = {int(e): e for e in ENCODING_DTYPE}
QUANTIZED_CODES: frozenset = frozenset(int(e) for e in ENCODING_DTYPE if _C.encoding_quantized(e))


def as_encoding(value) -> Encoding:
    """Accepts an Encoding, a name ('bf16', 'int8', 'fp8_e4m3_b128', ...) or an unquantized
    torch dtype."""
    if isinstance(value, Encoding):
        return value
    if isinstance(value, torch.dtype):
        if value not in ENCODING_OF_DTYPE:
            raise ValueError(
                f"dtype {value} has no unquantized encoding; expected one of "
                f"{sorted(str(d) for d in ENCODING_OF_DTYPE)}"
            )
        return ENCODING_OF_DTYPE[value]
    if isinstance(value, str) and value.lower() in _NAMES:
        return _NAMES[value.lower()]
    raise ValueError(f"unknown encoding {value!r}; expected one of {sorted(_NAMES)}")


def scales_per_token(encoding: Encoding, hidden: int) -> int:
    return _C.encoding_scales_per_token(encoding, hidden)


@dataclass(frozen=True)
class SlotLayout:
    """What a client and a server agree on at connect time; slots are sized for max_tokens.

    `encoding` is the encoding of request activations (possibly quantized), `out_encoding` the
    one of response activations (never quantized). `max_response_tokens` (0: max_tokens) sizes
    the response slots on their own, for peers that answer more rows than they were sent (one
    per (token, k) copy).
    """

    max_tokens: int
    hidden: int
    topk: int
    encoding: Encoding = Encoding.BF16
    out_encoding: Encoding = Encoding.BF16
    max_response_tokens: int = 0

    def __post_init__(self):
        object.__setattr__(self, "encoding", as_encoding(self.encoding))
        object.__setattr__(self, "out_encoding", as_encoding(self.out_encoding))
        if self.max_response_tokens < 0:
            raise ValueError(f"max_response_tokens must be >= 0, got {self.max_response_tokens}")
        self.config  # validates sizes  # noqa: B018

    @property
    def config(self) -> SlotConfig:
        return SlotConfig(
            self.max_tokens,
            self.hidden,
            self.topk,
            self.encoding,
            self.out_encoding,
            self.max_response_tokens,
        )

    @property
    def request_slot_bytes(self) -> int:
        return self.config.request_slot_bytes

    @property
    def response_slot_bytes(self) -> int:
        return self.config.response_slot_bytes

    def request_payload(
        self, num_tokens: int, topk: int | None = None, encoding: Encoding | None = None
    ) -> dict:
        """Offsets (relative to the payload) and sizes of a request of num_tokens."""
        enc = self.encoding if encoding is None else as_encoding(encoding)
        return _C.request_payload_layout(
            num_tokens, self.hidden, self.topk if topk is None else topk, enc
        )

    def to_dict(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "hidden": self.hidden,
            "topk": self.topk,
            "encoding": self.encoding.name,
            "out_encoding": self.out_encoding.name,
            "max_response_tokens": self.max_response_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict) -> SlotLayout:
        return cls(
            int(d["max_tokens"]),
            int(d["hidden"]),
            int(d["topk"]),
            as_encoding(d["encoding"]),
            as_encoding(d["out_encoding"]),
            int(d.get("max_response_tokens", 0)),
        )
