"""Header validation: every corrupted field gets its own code; nothing reads outside the slot."""

import pytest
from header_model import pack, valid_request, validate
from moecomm import _C
from moecomm.wire.protocol import (
    PAYLOAD_OFFSET,
    Encoding,
    Expectation,
    MessageKind,
    SlotHeader,
    SlotLayout,
    ValidateCode,
    validate_header,
    validate_reason,
)

MAX_TOKENS, HIDDEN, TOPK, CLIENT, SEQ = 8, 96, 2, 7, 11
LAYOUT = SlotLayout(MAX_TOKENS, HIDDEN, TOPK)
REQ_SLOT = LAYOUT.request_slot_bytes
RESP_SLOT = LAYOUT.response_slot_bytes


def expect(kind=MessageKind.REQUEST, slot_bytes=REQ_SLOT, seq=SEQ):
    return Expectation(kind, LAYOUT.config, slot_bytes, CLIENT, seq)


def check(fields: dict, kind=MessageKind.REQUEST, slot_bytes=REQ_SLOT) -> ValidateCode:
    raw = pack(**fields)
    code = validate_header(SlotHeader.from_bytes(raw), expect(kind, slot_bytes))
    slot = bytes(64) + raw + bytes(max(0, slot_bytes - 128))
    guarded = _C.validate_slot_guarded(slot[:slot_bytes], expect(kind, slot_bytes))
    model = validate(fields, kind, MAX_TOKENS, HIDDEN, TOPK, slot_bytes, CLIENT, SEQ)
    assert guarded == code == model, (guarded, code, model)
    return code


def test_valid_request_passes():
    assert check(valid_request(4, HIDDEN, TOPK, client_id=CLIENT, seq=SEQ)) == ValidateCode.OK
    # Full slot: max_tokens and max topk exactly fit.
    full = valid_request(MAX_TOKENS, HIDDEN, TOPK, client_id=CLIENT, seq=SEQ)
    assert check(full) == ValidateCode.OK


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("magic", 0, ValidateCode.BAD_MAGIC),
        ("magic", 0x4C53434E, ValidateCode.BAD_MAGIC),
        ("version", 1, ValidateCode.BAD_VERSION),
        ("version", 3, ValidateCode.BAD_VERSION),
        ("kind", int(MessageKind.RESPONSE), ValidateCode.BAD_KIND),
        ("kind", 0, ValidateCode.BAD_KIND),
        ("reserved0", 1, ValidateCode.RESERVED_NONZERO),
        ("arrival_target", 1, ValidateCode.BAD_ARRIVAL_TARGET),
        ("client_id", CLIENT + 1, ValidateCode.CLIENT_MISMATCH),
        ("seq", SEQ - 1, ValidateCode.SEQ_MISMATCH),
        ("status", 1, ValidateCode.BAD_STATUS),
        ("encoding", 0, ValidateCode.BAD_ENCODING),
        ("encoding", 7, ValidateCode.BAD_ENCODING),
        ("encoding", 255, ValidateCode.BAD_ENCODING),
        ("num_tokens", 0, ValidateCode.ZERO_TOKENS),
        ("num_tokens", MAX_TOKENS + 1, ValidateCode.TOO_MANY_TOKENS),
        ("num_tokens", 2**32 - 1, ValidateCode.TOO_MANY_TOKENS),
        ("hidden", HIDDEN + 1, ValidateCode.HIDDEN_MISMATCH),
        ("hidden", 2**32 - 1, ValidateCode.HIDDEN_MISMATCH),
        ("topk", 0, ValidateCode.BAD_TOPK),
        ("topk", TOPK + 1, ValidateCode.BAD_TOPK),
        ("payload_bytes", 0, ValidateCode.PAYLOAD_SIZE_MISMATCH),
        ("payload_bytes", 2**64 - 1, ValidateCode.PAYLOAD_SIZE_MISMATCH),
    ],
)
def test_each_corrupted_request_field_has_its_code(field, value, code):
    fields = valid_request(4, HIDDEN, TOPK, client_id=CLIENT, seq=SEQ)
    fields[field] = value
    assert check(fields) == code
    assert validate_reason(code) not in ("ok", "unknown validation code")


def test_payload_that_does_not_fit_the_slot():
    # f32 activations are twice the bf16 size the slot was negotiated for: consistent header,
    # but the payload would run past the slot.
    fields = valid_request(
        MAX_TOKENS, HIDDEN, TOPK, enc=int(Encoding.F32), client_id=CLIENT, seq=SEQ
    )
    assert check(fields) == ValidateCode.PAYLOAD_EXCEEDS_SLOT


@pytest.mark.parametrize("slot_bytes", [0, 1, 8, 64, 127])
def test_slot_too_small_never_reads_the_header(slot_bytes):
    assert check(valid_request(client_id=CLIENT, seq=SEQ), slot_bytes=slot_bytes) == (
        ValidateCode.SLOT_TOO_SMALL
    )


def response(**over):
    f = valid_request(4, HIDDEN, 0, client_id=CLIENT, seq=SEQ)
    f.update(kind=int(MessageKind.RESPONSE), topk=0, payload_bytes=4 * HIDDEN * 2)
    f.update(over)
    return f


def test_response_rules():
    ok = response(payload_bytes=((4 * HIDDEN * 2 + 63) // 64) * 64)
    assert check(ok, MessageKind.RESPONSE, RESP_SLOT) == ValidateCode.OK
    quant = dict(ok, encoding=int(Encoding.INT8))
    assert check(quant, MessageKind.RESPONSE, RESP_SLOT) == ValidateCode.QUANTIZED_RESPONSE
    assert check(dict(ok, topk=1), MessageKind.RESPONSE, RESP_SLOT) == ValidateCode.BAD_TOPK
    # Error responses: known status, a reason that fits.
    err = dict(ok, status=102, payload_bytes=40, num_tokens=0)
    assert check(err, MessageKind.RESPONSE, RESP_SLOT) == ValidateCode.OK
    assert check(dict(err, status=99), MessageKind.RESPONSE, RESP_SLOT) == ValidateCode.BAD_STATUS
    assert check(dict(err, status=-1), MessageKind.RESPONSE, RESP_SLOT) == ValidateCode.BAD_STATUS
    too_long = dict(err, payload_bytes=RESP_SLOT - PAYLOAD_OFFSET + 1)
    assert check(too_long, MessageKind.RESPONSE, RESP_SLOT) == ValidateCode.PAYLOAD_EXCEEDS_SLOT


def test_header_bytes_round_trip():
    h = SlotHeader()
    h.layer_id, h.num_tokens, h.seq = 5, 3, 2**55
    again = SlotHeader.from_bytes(h.to_bytes())
    assert (again.layer_id, again.num_tokens, again.seq) == (5, 3, 2**55)
    with pytest.raises(ValueError, match="64 bytes"):
        SlotHeader.from_bytes(b"\x00" * 63)


def test_response_rows_sized_apart_from_request_rows():
    """max_response_tokens sizes the response slots on their own: answers may carry more rows
    than requests (one per (token, k) copy), requests stay bounded by max_tokens."""
    layout = SlotLayout(MAX_TOKENS, HIDDEN, TOPK, max_response_tokens=3 * MAX_TOKENS)
    assert layout.config.max_response_tokens == 3 * MAX_TOKENS
    assert layout.request_slot_bytes == REQ_SLOT
    assert layout.response_slot_bytes > RESP_SLOT
    assert SlotLayout.from_dict(layout.to_dict()) == layout
    assert SlotLayout.from_dict({**LAYOUT.to_dict()} | {"max_response_tokens": 0}) == LAYOUT

    def code(fields, kind, slot_bytes):
        e = Expectation(kind, layout.config, slot_bytes, CLIENT, SEQ)
        raw = pack(**fields)
        slot = bytes(64) + raw + bytes(max(0, slot_bytes - 128))
        guarded = _C.validate_slot_guarded(slot[:slot_bytes], e)
        assert guarded == validate_header(SlotHeader.from_bytes(raw), e)
        return guarded

    resp_slot = layout.response_slot_bytes
    for rows, want in ((3 * MAX_TOKENS, ValidateCode.OK), (3 * MAX_TOKENS + 1, None)):
        f = response(num_tokens=rows, payload_bytes=((rows * HIDDEN * 2 + 63) // 64) * 64)
        got = code(f, MessageKind.RESPONSE, resp_slot)
        assert got == (want or ValidateCode.TOO_MANY_TOKENS)
    # Requests are still held to max_tokens.
    over = valid_request(MAX_TOKENS + 1, HIDDEN, TOPK, client_id=CLIENT, seq=SEQ)
    assert code(over, MessageKind.REQUEST, layout.request_slot_bytes) == (
        ValidateCode.TOO_MANY_TOKENS
    )
    with pytest.raises(ValueError, match="max_response_tokens must be >= 0"):
        SlotLayout(MAX_TOKENS, HIDDEN, TOPK, max_response_tokens=-1)
