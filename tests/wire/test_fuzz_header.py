"""Hypothesis fuzzing of headers and slot sizes against the Python model of validation. The
slot image ends right before an unmapped page, so any read outside the slot crashes the test.

CI runs 2,000 examples (derandomized: the same ones every run, ~10 s); a long run (MOECOMM_LONG=1)
runs 10^5, and MOECOMM_FUZZ_EXAMPLES sets any count (e.g. 10^6)."""

import os

from header_model import MAGIC, VERSION, pack, request_total, response_total, validate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from long_run import LONG
from moecomm import _C
from moecomm.wire.protocol import Expectation, MessageKind, SlotConfig, SlotHeader, validate_header

# The default is sized for make test's budget on 2 cores; the long run covers 50x more.
EXAMPLES = int(os.environ.get("MOECOMM_FUZZ_EXAMPLES", 100_000 if LONG else 2_000))
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)


def near(value, lo, hi):
    """Mostly the right value, sometimes a neighbour, sometimes anything in range."""
    return st.one_of(
        st.just(value), st.integers(max(lo, value - 2), min(hi, value + 2)), st.integers(lo, hi)
    )


@st.composite
def cases(draw):
    max_tokens = draw(st.integers(1, 64))
    hidden = draw(st.integers(1, 300))
    topk = draw(st.integers(1, 9))
    enc = draw(st.integers(1, 6))
    out_enc = draw(st.integers(1, 3))
    kind = draw(st.sampled_from([MessageKind.REQUEST, MessageKind.RESPONSE, MessageKind.STAGE]))
    stage_ack = kind == MessageKind.STAGE and draw(st.booleans())
    cfg = SlotConfig(max_tokens, hidden, topk, _C.Encoding(enc), _C.Encoding(out_enc))
    data_ring = kind == MessageKind.REQUEST or (kind == MessageKind.STAGE and not stage_ack)
    full = cfg.request_slot_bytes if data_ring else cfg.response_slot_bytes
    slot_bytes = draw(st.one_of(st.just(full), st.integers(0, full + 64)))
    client, seq = draw(U64), draw(st.integers(0, 2**56 - 1))
    stage = kind == MessageKind.STAGE  # num_tokens / topk are chunk index / chunk count
    t = draw(near(0 if stage else max(1, max_tokens // 2), 0, 2**32 - 1))
    k = draw(near({MessageKind.REQUEST: topk, MessageKind.STAGE: 2}.get(kind, 0), 0, 2**32 - 1))
    henc = draw(near(enc if kind == MessageKind.REQUEST else out_enc, 0, 255))
    h_hidden = draw(near(hidden, 0, 2**32 - 1))
    if kind == MessageKind.STAGE:  # a chunk of opaque bytes: any size up to the slot
        total = 0 if stage_ack else draw(st.integers(0, full))
    elif henc in (1, 2, 3, 4, 5, 6) and t <= 2**20 and h_hidden <= 2**20 and k <= 64:
        total = (
            request_total(t, h_hidden, k, henc)
            if kind == MessageKind.REQUEST
            else response_total(t, h_hidden, henc)
        )
    else:
        total = 0
    fields = {
        "magic": draw(near(MAGIC, 0, 2**32 - 1)),
        "version": draw(near(VERSION, 0, 2**16 - 1)),
        "kind": draw(near(int(kind), 0, 255)),
        "encoding": henc,
        "layer_id": draw(U32),
        "num_tokens": t,
        "hidden": h_hidden,
        "topk": k,
        "payload_bytes": draw(st.one_of(st.just(total), U64)),
        "client_id": draw(st.one_of(st.just(client), U64)),
        "seq": draw(st.one_of(st.just(seq), st.integers(0, 2**64 - 1))),
        "status": draw(
            st.one_of(
                st.just(0),
                st.integers(-(2**31), 2**31 - 1),
                st.sampled_from([1, 16, 17, 99, 100, 103, 104, 105]),
            )
        ),
        "reserved0": draw(st.one_of(st.just(0), U32)),
        "arrival_target": draw(st.one_of(st.just(0), U64)),
    }
    return cfg, kind, slot_bytes, client, seq, fields, stage_ack


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(cases())
def test_validation_matches_model_and_stays_in_bounds(case):
    cfg, kind, slot_bytes, client, seq, fields, stage_ack = case
    raw = pack(**fields)
    e = Expectation(kind, cfg, slot_bytes, client, seq, stage_ack)
    image = (bytes(64) + raw + bytes(max(0, slot_bytes - 128)))[:slot_bytes]
    guarded = _C.validate_slot_guarded(image, e)
    direct = validate_header(SlotHeader.from_bytes(raw), e)
    model = validate(
        fields, kind, cfg.max_tokens, cfg.hidden, cfg.topk, slot_bytes, client, seq, stage_ack
    )
    assert guarded == model
    if slot_bytes >= 128:
        assert direct == model
