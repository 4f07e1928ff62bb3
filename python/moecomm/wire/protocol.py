"""The slot wire format from Python: encodings, signal words, slot layouts.

The single source of truth is csrc/protocol/; this module only adds the torch dtype of each
encoding and a friendly `SlotLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecomm import _C

Encoding = _C.Encoding
SlotState = _C.SlotState
MessageKind = _C.MessageKind
ResponseStatus = _C.ResponseStatus
ValidateCode = _C.ValidateCode
SlotConfig = _C.SlotConfig
SlotHeader = _C.SlotHeader
Expectation = _C.Expectation

make_signal = _C.make_signal
signal_state = _C.signal_state
signal_seq = _C.signal_seq
validate_header = _C.validate_header
validate_reason = _C.validate_reason

MAX_SEQ: int = _C.MAX_SEQ
PAYLOAD_OFFSET: int = _C.PAYLOAD_OFFSET
HEADER_OFFSET: int = _C.HEADER_OFFSET
SCALE_BLOCK: int = _C.SCALE_BLOCK

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
_UNQUANTIZED = {
    torch.bfloat16: Encoding.BF16,
    torch.float16: Encoding.FP16,
    torch.float32: Encoding.F32,
}


def as_encoding(value) -> Encoding:
    """Accepts an Encoding, a name ('bf16', 'int8', 'fp8_e4m3_b128', ...) or an unquantized
    torch dtype."""
    if isinstance(value, Encoding):
        return value
    if isinstance(value, torch.dtype):
        if value not in _UNQUANTIZED:
            raise ValueError(
                f"dtype {value} has no unquantized encoding; expected one of "
                f"{sorted(str(d) for d in _UNQUANTIZED)}"
            )
        return _UNQUANTIZED[value]
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
