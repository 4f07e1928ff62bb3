"""The JSON bodies of the prefill/decode split's internal routes (docs/router.md): what a router
sends a prefill front end (``POST /pd/prefill``) and a decode front end (``POST /pd/decode``),
checked field by field, so a malformed call is a 400 naming the field, never a 500 or a
request that runs on garbage. Shared by the front end's routes
(:mod:`moecomm_serving.disagg.routes`) and the router (:mod:`moecomm_serving.disagg.router`),
so both ends speak one format."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from dataclasses import dataclass

import torch
from moecomm.errors import MoecommError

from moecomm_serving.engine.generate import SamplingParams

# A router's id of one attempt; bounded so a hostile body cannot make every log line huge.
MAX_HANDOFF_ID_CHARS = 64
# The sampler state of torch's CPU generator (mt19937) is 5,056 bytes; base64 of a state
# beyond this is not one.
MAX_RNG_STATE_B64_CHARS = 16384
# Fields of a sampling params object, with their JSON types.
_PARAM_TYPES = {
    "max_new_tokens": int,
    "temperature": (int, float),
    "top_p": (int, float),
    "seed": (int, type(None)),
    "stop_token_ids": list,
    "ignore_eos": bool,
}


class PdRequestError(MoecommError, ValueError):
    """A prefill/decode call's body is malformed (HTTP 400); the message names the field."""


def params_to_json(p: SamplingParams) -> dict:
    d = dataclasses.asdict(p)
    d["stop_token_ids"] = list(p.stop_token_ids)
    return d


def params_from_json(d) -> SamplingParams:
    if not isinstance(d, dict):
        raise PdRequestError("params must be an object")
    unknown = set(d) - set(_PARAM_TYPES)
    if unknown:
        raise PdRequestError(f"params: unknown fields {sorted(unknown)}")
    for name, kind in _PARAM_TYPES.items():
        if name in d and (not isinstance(d[name], kind) or _is_bool_number(d[name], kind)):
            raise PdRequestError(f"params.{name} has the wrong type: {d[name]!r}")
    stops = d.get("stop_token_ids", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stops):
        raise PdRequestError("params.stop_token_ids must be a list of ints")
    try:
        return SamplingParams(**{**d, "stop_token_ids": tuple(stops)})
    except ValueError as exc:
        raise PdRequestError(f"params: {exc}") from None


def _is_bool_number(value, kind) -> bool:
    """JSON true/false is not a number here (Python's bool is an int)."""
    return isinstance(value, bool) and kind is not bool


def rng_to_json(state: torch.Tensor | None) -> str | None:
    return None if state is None else base64.b64encode(state.numpy().tobytes()).decode("ascii")


def rng_from_json(value) -> torch.Tensor | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_RNG_STATE_B64_CHARS:
        raise PdRequestError("rng must be null or the base64 of a sampler state")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise PdRequestError("rng is not valid base64") from None
    return (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )


@dataclass(frozen=True)
class PrefillCall:
    handoff_id: str
    prompt: list[int]
    params: SamplingParams
    decode_url: str

    def to_json(self) -> dict:
        return {
            "handoff_id": self.handoff_id,
            "prompt": self.prompt,
            "params": params_to_json(self.params),
            "decode_url": self.decode_url,
        }


@dataclass(frozen=True)
class DecodeCall:
    handoff_id: str
    prompt: list[int]
    tokens: list[int]
    params: SamplingParams
    rng: torch.Tensor | None
    client_id: int
    tag: int

    def to_json(self) -> dict:
        return {
            "handoff_id": self.handoff_id,
            "prompt": self.prompt,
            "tokens": self.tokens,
            "params": params_to_json(self.params),
            "rng": rng_to_json(self.rng),
            "kv": {"client_id": self.client_id, "tag": self.tag},
        }


def _body(raw: bytes, fields: set[str]) -> dict:
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PdRequestError(f"the body is not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise PdRequestError("the body must be a JSON object")
    missing, unknown = fields - set(d), set(d) - fields
    if missing:
        raise PdRequestError(f"missing fields {sorted(missing)}")
    if unknown:
        raise PdRequestError(f"unknown fields {sorted(unknown)}")
    hid = d["handoff_id"]
    if not isinstance(hid, str) or not 0 < len(hid) <= MAX_HANDOFF_ID_CHARS:
        raise PdRequestError(f"handoff_id must be a string of 1..{MAX_HANDOFF_ID_CHARS} chars")
    return d


def _ints(value, name: str, nonempty: bool = True) -> list[int]:
    if not isinstance(value, list) or (nonempty and not value):
        raise PdRequestError(f"{name} must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise PdRequestError(f"{name} must hold token ids (ints >= 0)")
    return value


def parse_prefill(raw: bytes) -> PrefillCall:
    d = _body(raw, {"handoff_id", "prompt", "params", "decode_url"})
    url = d["decode_url"]
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise PdRequestError("decode_url must be an http(s) URL")
    return PrefillCall(
        d["handoff_id"], _ints(d["prompt"], "prompt"), params_from_json(d["params"]), url
    )


def parse_decode(raw: bytes) -> DecodeCall:
    d = _body(raw, {"handoff_id", "prompt", "tokens", "params", "rng", "kv"})
    kv = d["kv"]
    if not isinstance(kv, dict) or set(kv) != {"client_id", "tag"}:
        raise PdRequestError('kv must be {"client_id": int, "tag": int}')
    for name in ("client_id", "tag"):
        v = kv[name]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise PdRequestError(f"kv.{name} must be an int >= 0")
    return DecodeCall(
        d["handoff_id"],
        _ints(d["prompt"], "prompt"),
        _ints(d["tokens"], "tokens"),
        params_from_json(d["params"]),
        rng_from_json(d["rng"]),
        kv["client_id"],
        kv["tag"],
    )
