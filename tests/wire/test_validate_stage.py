"""Validation of stage messages (MessageKind.STAGE): chunks in a data ring, header-only acks in
the sender's ack ring; every corrupted field gets its code, and a stage message is never taken
for an expert request or response (nor the reverse)."""

import pytest
from header_model import pack, valid_request, valid_stage, validate
from moecomm import _C
from moecomm.wire.protocol import (
    PAYLOAD_OFFSET,
    Expectation,
    MessageKind,
    SlotHeader,
    ValidateCode,
    validate_header,
)
from moecomm.wire.stage import stage_layout

ROWS, HIDDEN, CLIENT, SEQ = 4, 96, 7, 11
LAYOUT = stage_layout(ROWS, HIDDEN, "f32")
DATA_SLOT = LAYOUT.request_slot_bytes
ACK_SLOT = LAYOUT.response_slot_bytes
CAPACITY = DATA_SLOT - PAYLOAD_OFFSET


def check(fields: dict, kind=MessageKind.STAGE, ack=False) -> ValidateCode:
    slot_bytes = ACK_SLOT if ack else DATA_SLOT
    e = Expectation(kind, LAYOUT.config, slot_bytes, CLIENT, SEQ, ack)
    raw = pack(**fields)
    code = validate_header(SlotHeader.from_bytes(raw), e)
    image = (bytes(64) + raw + bytes(max(0, slot_bytes - 128)))[:slot_bytes]
    guarded = _C.validate_slot_guarded(image, e)
    model = validate(fields, kind, ROWS, HIDDEN, 1, slot_bytes, CLIENT, SEQ, ack)
    assert guarded == code == model, (guarded, code, model)
    return code


def chunk(**over) -> dict:
    return {**valid_stage(0, 2, 100, HIDDEN, CLIENT, SEQ), **over}


def test_valid_chunks_and_acks_pass():
    assert check(chunk()) == ValidateCode.OK
    assert check(chunk(num_tokens=1, payload_bytes=CAPACITY)) == ValidateCode.OK  # a full slot
    assert check(chunk(payload_bytes=0), ack=True) == ValidateCode.OK
    refusal = chunk(status=int(ValidateCode.BAD_KIND), payload_bytes=40)
    assert check(refusal, ack=True) == ValidateCode.OK


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("kind", int(MessageKind.REQUEST), ValidateCode.BAD_KIND),
        ("kind", int(MessageKind.RESPONSE), ValidateCode.BAD_KIND),
        ("reserved0", 1, ValidateCode.RESERVED_NONZERO),
        ("client_id", CLIENT + 1, ValidateCode.CLIENT_MISMATCH),
        ("seq", SEQ + 1, ValidateCode.SEQ_MISMATCH),
        ("status", 102, ValidateCode.BAD_STATUS),  # a chunk carries no status
        ("encoding", 0, ValidateCode.BAD_ENCODING),
        ("encoding", 4, ValidateCode.BAD_ENCODING),  # quantized: a package has no scales
        ("hidden", HIDDEN + 1, ValidateCode.HIDDEN_MISMATCH),
        ("topk", 0, ValidateCode.BAD_TOPK),  # zero chunks
        ("num_tokens", 2, ValidateCode.BAD_TOPK),  # chunk index beyond the count
        ("payload_bytes", 0, ValidateCode.PAYLOAD_SIZE_MISMATCH),
        ("payload_bytes", CAPACITY + 1, ValidateCode.PAYLOAD_EXCEEDS_SLOT),
        ("payload_bytes", 2**64 - 1, ValidateCode.PAYLOAD_EXCEEDS_SLOT),
    ],
)
def test_each_corrupted_chunk_field_has_its_code(field, value, code):
    assert check(chunk(**{field: value})) == code


def test_ack_rules():
    assert check(chunk(payload_bytes=1), ack=True) == ValidateCode.PAYLOAD_SIZE_MISMATCH
    assert check(chunk(payload_bytes=0, status=99), ack=True) == ValidateCode.BAD_STATUS
    too_long = chunk(status=102, payload_bytes=ACK_SLOT - PAYLOAD_OFFSET + 1)
    assert check(too_long, ack=True) == ValidateCode.PAYLOAD_EXCEEDS_SLOT
    # The ack ring is small: one header plus room for a reason, not a chunk's worth.
    assert ACK_SLOT < DATA_SLOT


def test_kinds_are_not_interchangeable():
    """A stage chunk read where an expert request is expected is refused, and the reverse."""
    stage = chunk()
    request = valid_request(2, HIDDEN, 1, client_id=CLIENT, seq=SEQ)
    assert check(stage, kind=MessageKind.REQUEST) == ValidateCode.BAD_KIND
    assert check(stage, kind=MessageKind.RESPONSE) == ValidateCode.BAD_KIND
    assert check(request, kind=MessageKind.STAGE) == ValidateCode.BAD_KIND
    assert check(request, kind=MessageKind.STAGE, ack=True) == ValidateCode.BAD_KIND
