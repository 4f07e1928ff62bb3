"""An independent Python model of header validation (csrc/protocol/validate.h), written from
the rules of docs/design.md ("Header validation"), used by the tests as a differential oracle."""

from __future__ import annotations

import struct

from moecomm.wire.protocol import PAYLOAD_OFFSET, Encoding, MessageKind, ValidateCode

MAGIC = 0x4C53434D
VERSION = 2
HEADER_FMT = "<IHBBIIIIQQQiIQ"  # the 64-byte SlotHeader, little-endian
FIELDS = (
    "magic",
    "version",
    "kind",
    "encoding",
    "layer_id",
    "num_tokens",
    "hidden",
    "topk",
    "payload_bytes",
    "client_id",
    "seq",
    "status",
    "reserved0",
    "arrival_target",
)
ELEM = {1: 2, 2: 2, 3: 4, 4: 1, 5: 1, 6: 1}
QUANTIZED = {4, 5, 6}
SERVER_STATUSES = {100, 101, 102, 103, 104}
NUM_CODES = 18


def up(x: int) -> int:
    return (x + 63) // 64 * 64


def scales(enc: int, hidden: int) -> int:
    return {4: 1, 5: 1, 6: (hidden + 127) // 128}.get(enc, 0)


def request_total(t: int, h: int, k: int, enc: int) -> int:
    off = up(t * h * ELEM[enc])
    off = up(off + t * scales(enc, h) * 4)
    off = up(off + t * k * 4)
    return up(off + t * k * 4)


def response_total(t: int, h: int, enc: int) -> int:
    return up(t * h * ELEM[enc])


def pack(**f) -> bytes:
    return struct.pack(HEADER_FMT, *(f[name] for name in FIELDS))


def unpack(b: bytes) -> dict:
    return dict(zip(FIELDS, struct.unpack(HEADER_FMT, b), strict=True))


def validate(
    h: dict,
    kind: MessageKind,
    max_tokens: int,
    hidden: int,
    topk: int,
    slot_bytes: int,
    client_id: int,
    seq: int,
    stage_ack: bool = False,
) -> ValidateCode:
    V = ValidateCode
    if slot_bytes < PAYLOAD_OFFSET:
        return V.SLOT_TOO_SMALL
    if h["magic"] != MAGIC:
        return V.BAD_MAGIC
    if h["version"] != VERSION:
        return V.BAD_VERSION
    if h["kind"] != int(kind):
        return V.BAD_KIND
    if h["reserved0"]:
        return V.RESERVED_NONZERO
    if h["client_id"] != client_id:
        return V.CLIENT_MISMATCH
    if h["seq"] != seq:
        return V.SEQ_MISMATCH
    if h["arrival_target"] and h["arrival_target"] < h["payload_bytes"]:
        return V.BAD_ARRIVAL_TARGET
    if kind == MessageKind.STAGE:
        return validate_stage(h, hidden, slot_bytes, stage_ack)
    request = kind == MessageKind.REQUEST
    st = h["status"]
    status_ok = st == 0 if request else (0 <= st < NUM_CODES or st in SERVER_STATUSES)
    if not status_ok:
        return V.BAD_STATUS
    capacity = slot_bytes - PAYLOAD_OFFSET
    if not request and st != 0:
        return V.PAYLOAD_EXCEEDS_SLOT if h["payload_bytes"] > capacity else V.OK
    enc = h["encoding"]
    if enc not in ELEM:
        return V.BAD_ENCODING
    if not request and enc in QUANTIZED:
        return V.QUANTIZED_RESPONSE
    t = h["num_tokens"]
    if t == 0:
        return V.ZERO_TOKENS
    if t > max_tokens:
        return V.TOO_MANY_TOKENS
    if h["hidden"] != hidden:
        return V.HIDDEN_MISMATCH
    if (h["topk"] == 0 or h["topk"] > topk) if request else h["topk"] != 0:
        return V.BAD_TOPK
    total = request_total(t, hidden, h["topk"], enc) if request else response_total(t, hidden, enc)
    if h["payload_bytes"] != total:
        return V.PAYLOAD_SIZE_MISMATCH
    if total > capacity:
        return V.PAYLOAD_EXCEEDS_SLOT
    return V.OK


def validate_stage(h: dict, hidden: int, slot_bytes: int, ack: bool) -> ValidateCode:
    """A stage chunk (1..capacity opaque bytes, chunk index < chunk count) or its ack (no
    payload; a refusal carries its reason)."""
    V = ValidateCode
    capacity = slot_bytes - PAYLOAD_OFFSET
    st = h["status"]
    if ack:
        if not (0 <= st < NUM_CODES or st in SERVER_STATUSES):
            return V.BAD_STATUS
        if st != 0:
            return V.PAYLOAD_EXCEEDS_SLOT if h["payload_bytes"] > capacity else V.OK
    elif st != 0:
        return V.BAD_STATUS
    if h["encoding"] not in ELEM or h["encoding"] in QUANTIZED:
        return V.BAD_ENCODING
    if h["hidden"] != hidden:
        return V.HIDDEN_MISMATCH
    if h["topk"] == 0 or h["num_tokens"] >= h["topk"]:
        return V.BAD_TOPK
    if (h["payload_bytes"] != 0) if ack else (h["payload_bytes"] == 0):
        return V.PAYLOAD_SIZE_MISMATCH
    if h["payload_bytes"] > capacity:
        return V.PAYLOAD_EXCEEDS_SLOT
    return V.OK


def valid_stage(chunk=0, count=2, nbytes=100, hidden=96, client_id=7, seq=11) -> dict:
    return {
        **valid_request(hidden=hidden, client_id=client_id, seq=seq),
        "kind": int(MessageKind.STAGE),
        "encoding": int(Encoding.F32),
        "num_tokens": chunk,
        "topk": count,
        "payload_bytes": nbytes,
    }


def valid_request(
    num_tokens=4, hidden=96, topk=2, enc=int(Encoding.BF16), client_id=7, seq=11
) -> dict:
    return {
        "magic": MAGIC,
        "version": VERSION,
        "kind": int(MessageKind.REQUEST),
        "encoding": enc,
        "layer_id": 3,
        "num_tokens": num_tokens,
        "hidden": hidden,
        "topk": topk,
        "payload_bytes": request_total(num_tokens, hidden, topk, enc),
        "client_id": client_id,
        "seq": seq,
        "status": 0,
        "reserved0": 0,
        "arrival_target": 0,
    }
