"""Slot layout: offsets, sizes and alignment computed from (tokens, hidden, topk, encoding)."""

import itertools

import pytest
from moecomm import _C
from moecomm.wire.protocol import (
    HEADER_OFFSET,
    PAYLOAD_OFFSET,
    Encoding,
    SlotLayout,
    SlotState,
    as_encoding,
    make_signal,
    scales_per_token,
    signal_seq,
    signal_state,
)

ALIGN = 64
ELEM = {
    Encoding.BF16: 2,
    Encoding.FP16: 2,
    Encoding.F32: 4,
    Encoding.INT8: 1,
    Encoding.FP8_E4M3: 1,
    Encoding.FP8_E4M3_B128: 1,
}


def up(x):
    return (x + ALIGN - 1) // ALIGN * ALIGN


def test_fixed_offsets():
    assert _C.HEADER_BYTES == 64
    assert HEADER_OFFSET == 64
    assert PAYLOAD_OFFSET == 128
    assert _C.DOORBELL_BYTES == 64


@pytest.mark.parametrize(
    ("tokens", "hidden", "topk", "enc"),
    list(itertools.product([0, 1, 3, 128], [1, 111, 128, 7168], [1, 8], list(ELEM))),
)
def test_request_payload_layout(tokens, hidden, topk, enc):
    p = SlotLayout(max(tokens, 1), hidden, topk, enc).request_payload(tokens)
    s = scales_per_token(enc, hidden)
    assert p["act_offset"] == 0
    assert p["act_bytes"] == tokens * hidden * ELEM[enc]
    assert p["scale_offset"] == up(p["act_bytes"])
    assert p["scale_bytes"] == tokens * s * 4
    assert p["ids_offset"] == up(p["scale_offset"] + p["scale_bytes"])
    assert p["ids_bytes"] == tokens * topk * 4
    assert p["scores_offset"] == up(p["ids_offset"] + p["ids_bytes"])
    assert p["scores_bytes"] == tokens * topk * 4
    assert p["total"] == up(p["scores_offset"] + p["scores_bytes"])
    for key in ("act_offset", "scale_offset", "ids_offset", "scores_offset", "total"):
        assert p[key] % ALIGN == 0


@pytest.mark.parametrize(("hidden", "want"), [(1, 1), (111, 1), (128, 1), (129, 2), (7168, 56)])
def test_block_scales_per_token(hidden, want):
    assert scales_per_token(Encoding.FP8_E4M3_B128, hidden) == want
    assert scales_per_token(Encoding.INT8, hidden) == 1
    assert scales_per_token(Encoding.FP8_E4M3, hidden) == 1
    assert scales_per_token(Encoding.BF16, hidden) == 0


@pytest.mark.parametrize("enc", [Encoding.BF16, Encoding.INT8, Encoding.FP8_E4M3_B128])
def test_slot_sizes_and_region(enc):
    lay = SlotLayout(128, 7168, 8, enc)
    req = lay.request_payload(128)
    assert lay.request_slot_bytes == PAYLOAD_OFFSET + req["total"]
    assert lay.response_slot_bytes == PAYLOAD_OFFSET + up(128 * 7168 * 2)
    assert lay.request_slot_bytes % ALIGN == 0
    ring = _C.SlotRing(lay.config, 3, True)
    assert ring.region_bytes == 64 + 3 * lay.request_slot_bytes
    assert [ring.slot_offset(i) for i in range(3)] == [
        64 + i * lay.request_slot_bytes for i in range(3)
    ]


def test_tiny_response_slot_still_fits_an_error_reason():
    lay = SlotLayout(1, 1, 1, Encoding.BF16)
    assert lay.response_slot_bytes >= PAYLOAD_OFFSET + 256


def test_decode_size_numbers():
    # 128 tokens x 7168 bf16 + top-8 ids and scores: the decode-size case of the benchmark.
    lay = SlotLayout(128, 7168, 8)
    assert lay.request_payload(128)["total"] == 128 * 7168 * 2 + 2 * 128 * 8 * 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0, "hidden": 8, "topk": 1}, "max_tokens"),
        ({"max_tokens": 1, "hidden": 0, "topk": 1}, "hidden"),
        ({"max_tokens": 1, "hidden": 8, "topk": 0}, "topk"),
        ({"max_tokens": 1, "hidden": 8, "topk": 1, "out_encoding": "int8"}, "quantized"),
        ({"max_tokens": 1, "hidden": 8, "topk": 1, "encoding": "fp4"}, "unknown encoding"),
    ],
)
def test_bad_layouts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SlotLayout(**kwargs)


def test_layout_dict_round_trip():
    lay = SlotLayout(7, 111, 3, "fp8_e4m3_b128", "f32")
    assert SlotLayout.from_dict(lay.to_dict()) == lay
    assert as_encoding("BF16") == Encoding.BF16


@pytest.mark.parametrize("state", list(SlotState.__members__.values()))
@pytest.mark.parametrize("seq", [0, 1, 255, 256, 2**40 + 5, 2**56 - 1])
def test_signal_word(state, seq):
    w = make_signal(state, seq)
    assert w & 0xFF == int(state)
    assert signal_state(w) == state
    assert signal_seq(w) == seq


def test_signal_seq_wraps_at_56_bits_and_unknown_state_is_an_error():
    assert signal_seq(make_signal(SlotState.IDLE, 2**56 + 3)) == 3
    with pytest.raises(ValueError, match="unknown state"):
        signal_state(0x17)
