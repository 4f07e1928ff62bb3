"""The prefill/decode split's call bodies (pd_wire): round trips, and every malformed field a
400 naming it (PdRequestError), never another exception — fuzzed with a fixed seed."""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch
from moecomm_serving.disagg.schema import (
    DecodeCall,
    PdRequestError,
    PrefillCall,
    params_from_json,
    params_to_json,
    parse_decode,
    parse_prefill,
)
from moecomm_serving.engine.generate import SamplingParams

SEED = 31
FUZZ_CASES = 300
SAMPLED = SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.8, seed=3, stop_token_ids=(2,))


def good_prefill() -> dict:
    return PrefillCall("h-1", [1, 2, 3], SAMPLED, "http://127.0.0.1:9/").to_json()


def good_decode() -> dict:
    rng = torch.Generator().manual_seed(1).get_state()
    return DecodeCall("h-1", [1, 2, 3], [4], SAMPLED, rng, 7, 1).to_json()


def test_round_trips():
    assert params_from_json(params_to_json(SAMPLED)) == SAMPLED
    assert parse_prefill(json.dumps(good_prefill()).encode()).params == SAMPLED
    call = parse_decode(json.dumps(good_decode()).encode())
    assert (call.client_id, call.tag, call.tokens) == (7, 1, [4])
    assert torch.equal(call.rng, torch.Generator().manual_seed(1).get_state())


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
    seeds = [json.dumps(good_prefill()).encode(), json.dumps(good_decode()).encode()]
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
        for parse in (parse_prefill, parse_decode):
            with contextlib.suppress(PdRequestError):
                parse(bytes(raw))
