"""The prefill/decode split's messages (disagg.schema): round trips of every call, answer and
stream line, and every malformed field a PdRequestError naming it (a 400 for a call, a faulty
front end for an answer), never another exception — fuzzed with a fixed seed."""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch
from moecomm_serving.disagg.schema import (
    DecodeCall,
    DecodeError,
    DecodeToken,
    KvReceipt,
    PdRequestError,
    PrefillAnswer,
    PrefillCall,
    ReserveAnswer,
    ReserveCall,
    params_from_json,
    params_to_json,
    parse_line,
    to_line,
)
from moecomm_serving.types import KvPackage, SamplingParams

SEED = 31
FUZZ_CASES = 300
SAMPLED = SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.8, seed=3, stop_token_ids=(2,))


def good_prefill() -> dict:
    return PrefillCall("h-1", [1, 2, 3], SAMPLED, "http://127.0.0.1:9/").to_json()


def rng_state() -> bytes:
    return bytes(torch.Generator().manual_seed(1).get_state().numpy())


def good_decode() -> dict:
    return DecodeCall("h-1", [1, 2, 3], [4], SAMPLED, rng_state(), 7, 1).to_json()


def good_answer() -> dict:
    kv = KvReceipt(7, 1, 4096, 0.01, "shm")
    return PrefillAnswer(5, None, kv, rng_state(), 0.2, 16).to_json()


PACKAGE = KvPackage(2, 21, 8, (0, 1, 2), (2, 16, 16), "float32")


def good_reserve() -> dict:
    return ReserveCall("h-1", PACKAGE, '{"version": 1}').to_json()


parse_prefill, parse_decode = PrefillCall.from_json, DecodeCall.from_json


def test_round_trips():
    assert params_from_json(params_to_json(SAMPLED)) == SAMPLED
    call = parse_prefill(json.dumps(good_prefill()).encode())
    assert call == PrefillCall("h-1", [1, 2, 3], SAMPLED, "http://127.0.0.1:9/")
    decode = parse_decode(json.dumps(good_decode()).encode())
    assert (decode.client_id, decode.tag, decode.tokens) == (7, 1, [4])
    assert decode.rng == rng_state()
    answer = PrefillAnswer.from_json(json.dumps(good_answer()).encode())
    assert answer.kv == KvReceipt(7, 1, 4096, 0.01, "shm") and answer.rng == rng_state()
    # the decode call the router builds from the prefill's call and answer
    assert DecodeCall.after_prefill(call, answer) == DecodeCall(
        "h-1", [1, 2, 3], [5], SAMPLED, rng_state(), 7, 1
    )
    finished = PrefillAnswer(5, "stop", None, None, 0.1, 0)
    assert PrefillAnswer.from_json(finished.to_json()) == finished
    for line in (DecodeToken(3), DecodeToken(4, "length"), DecodeError("engine failed", 500)):
        assert parse_line(to_line(line)) == line
    reserve = ReserveCall.from_json(json.dumps(good_reserve()).encode())
    assert reserve == ReserveCall("h-1", PACKAGE, '{"version": 1}')
    assert reserve.kv.num_blocks == 3
    ans = ReserveAnswer('{"pool": 1}', '{"dst": [4]}')
    assert ReserveAnswer.from_json(json.dumps(ans.to_json())) == ans
    # a staged hand-off (another host) says so in the decode call's kv; a pool-to-pool one
    # keeps the kv object of before
    staged = PrefillAnswer(5, None, KvReceipt(7, 1, 4096, 0.01, "nixl"), None, 0.2, 0)
    decode = DecodeCall.after_prefill(call, staged)
    assert decode.transport == "nixl" and decode.to_json()["kv"]["transport"] == "nixl"
    assert parse_decode(json.dumps(decode.to_json())) == decode
    assert set(good_decode()["kv"]) == {"client_id", "tag"}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"kv": None}, "kv"),
        ({"kv": {**PACKAGE.meta(), "length": 0}}, "kv.length"),
        ({"kv": {**PACKAGE.meta(), "block_tokens": True}}, "kv.block_tokens"),
        ({"kv": {**PACKAGE.meta(), "layers": []}}, "kv.layers"),
        ({"kv": {**PACKAGE.meta(), "layers": list(range(2000))}}, "kv.layers"),
        ({"kv": {**PACKAGE.meta(), "kv_shape": [1, 2]}}, "kv.kv_shape"),
        ({"kv": {**PACKAGE.meta(), "kv_shape": [1, 0, 2]}}, "kv.kv_shape"),
        ({"kv": {**PACKAGE.meta(), "dtype": 3}}, "kv.dtype"),
        ({"kv": {**PACKAGE.meta(), "k": [1]}}, "k"),
        ({"pool": {"version": 1}}, "pool"),
        ({"pool": ""}, "pool"),
        ({"handoff_id": ""}, "handoff_id"),
        ({"extra": 1}, "extra"),
    ],
)
def test_reserve_refusals_name_the_field(change, field):
    with pytest.raises(PdRequestError, match=field):
        ReserveCall.from_json({**good_reserve(), **change})
    with pytest.raises(PdRequestError, match="request"):
        ReserveAnswer.from_json({"pool": "{}", "request": 5})


@pytest.mark.parametrize(
    "change, field",
    [
        ({"token": -1}, "token"),
        ({"token": "5"}, "token"),
        ({"finish": 3}, "finish"),
        ({"kv": None}, "kv"),  # an unfinished request without its package
        ({"kv": {"client_id": 1}}, "kv"),
        ({"kv": {**good_answer()["kv"], "tag": True}}, "kv.tag"),
        ({"kv": {**good_answer()["kv"], "transfer_s": "x"}}, "kv.transfer_s"),
        ({"rng": "!!!"}, "rng"),
        ({"prefill_s": -1}, "prefill_s"),
        ({"cached_tokens": 1.5}, "cached_tokens"),
        ({"extra": 1}, "extra"),
    ],
)
def test_answer_refusals_name_the_field(change, field):
    with pytest.raises(PdRequestError, match=field):
        PrefillAnswer.from_json({**good_answer(), **change})


@pytest.mark.parametrize(
    "line, field",
    [
        (b'{"token": -3, "finish": null}', "token"),
        (b'{"token": 3}', "finish"),
        (b'{"error": {"message": 1, "status": 500}}', "message"),
        (b'{"error": {"message": "x", "status": 42}}', "status"),
        (b'{"error": "x"}', "error"),
        (b"[1]", "object"),
    ],
)
def test_stream_line_refusals_name_the_field(line, field):
    with pytest.raises(PdRequestError, match=field):
        parse_line(line)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": "abc"}, "prompt"),
        ({"handoff_id": ""}, "handoff_id"),
        ({"handoff_id": "x" * 65}, "handoff_id"),
        ({"decode_url": "file:///etc/passwd"}, "decode_url"),
        ({"params": {"max_new_tokens": 0}}, "max_new_tokens"),
        ({"params": {"temperature": "hot"}}, "temperature"),
        ({"params": {"max_new_tokens": True}}, "max_new_tokens"),
        ({"params": {"bogus": 1}}, "bogus"),
        ({"params": {"stop_token_ids": ["a"]}}, "stop_token_ids"),
        ({"extra": 1}, "extra"),
    ],
)
def test_prefill_refusals_name_the_field(change, field):
    body = {**good_prefill(), **change}
    with pytest.raises(PdRequestError, match=field):
        parse_prefill(json.dumps(body).encode())


@pytest.mark.parametrize(
    "change, field",
    [
        ({"tokens": []}, "tokens"),
        ({"kv": {"client_id": 1}}, "kv"),
        ({"kv": {"client_id": -1, "tag": 1}}, "client_id"),
        ({"kv": {"client_id": 1, "tag": "1"}}, "tag"),
        ({"rng": "!!!"}, "rng"),
        ({"rng": 5}, "rng"),
        ({"rng": "A" * 20000}, "rng"),
        ({"kv": {"client_id": 1, "tag": 1, "transport": 3}}, "kv.transport"),
        ({"kv": {"client_id": 1, "tag": 1, "transport": ""}}, "kv.transport"),
        ({"kv": {"client_id": 1, "tag": 1, "other": "x"}}, "kv"),
    ],
)
def test_decode_refusals_name_the_field(change, field):
    body = {**good_decode(), **change}
    with pytest.raises(PdRequestError, match=field):
        parse_decode(json.dumps(body).encode())


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b"\xff\xfe", b"null", b'{"handoff_id": 1}'])
def test_not_an_object_is_refused(raw):
    for parse in (parse_prefill, parse_decode):
        with pytest.raises(PdRequestError):
            parse(raw)


def test_fuzzed_bodies_are_parsed_or_refused_cleanly():
    rnd = random.Random(SEED)
    seeds = [json.dumps(m).encode() for m in (good_prefill(), good_decode(), good_reserve())]
    for _ in range(FUZZ_CASES):
        raw = bytearray(rnd.choice(seeds))
        for _ in range(rnd.randint(1, 4)):
            op = rnd.random()
            i = rnd.randrange(len(raw))
            if op < 0.4:
                raw[i] = rnd.randrange(256)
            elif op < 0.7:
                del raw[i : i + rnd.randint(1, 8)]
            else:
                raw[i:i] = bytes(rnd.randrange(32, 127) for _ in range(rnd.randint(1, 4)))
        for parse in (parse_prefill, parse_decode, ReserveCall.from_json):
            with contextlib.suppress(PdRequestError):
                parse(bytes(raw))
