"""The messages of the prefill/decode split's internal routes (docs/router.md), each defined
once and used by both of its ends: what a router sends a prefill front end
(:class:`PrefillCall`, ``POST /pd/prefill``) and what it answers (:class:`PrefillAnswer`), what
the router then sends a decode front end (:class:`DecodeCall`, ``POST /pd/decode``) and the
lines that stream back (:class:`DecodeToken`, :class:`DecodeError`).

Every message has ``to_json`` (what the sender writes) and ``from_json`` (what the receiver
reads), and ``from_json`` checks every field once: a malformed message is a
:class:`PdRequestError` naming the field (the front end answers 400, the router treats the
answering front end as faulty), never a KeyError or a request that runs on garbage. No torch
here: the sampler's state travels as the raw bytes of a torch generator state (base64 on the
wire), which the front end's routes turn back into a state.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from moecomm.errors import MoecommError

from moecomm_serving.types import SamplingParams

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
    """A prefill/decode message is malformed (a call: HTTP 400); the message names the field."""


# ------------------------------------------------------------------------------ field checks


def _object(raw: bytes | str | dict, what: str) -> dict:
    """A message's JSON object, from the raw body or the already parsed JSON."""
    if isinstance(raw, bytes | bytearray | str):
        try:
            raw = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PdRequestError(f"{what}: the body is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise PdRequestError(f"{what}: the body must be a JSON object")
    return raw


def _fields(d: dict, what: str, required: set[str], optional: frozenset[str] = frozenset()):
    missing, unknown = required - set(d), set(d) - required - optional
    if missing:
        raise PdRequestError(f"{what}: missing fields {sorted(missing)}")
    if unknown:
        raise PdRequestError(f"{what}: unknown fields {sorted(unknown)}")


def _int(value, name: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PdRequestError(f"{name} must be an int >= {minimum}, got {value!r:.40}")
    return value


def _number(value, name: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise PdRequestError(f"{name} must be a number >= 0, got {value!r:.40}")
    return float(value)


def _ints(value, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise PdRequestError(f"{name} must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise PdRequestError(f"{name} must hold token ids (ints >= 0)")
    return value


def _handoff_id(value) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_HANDOFF_ID_CHARS:
        raise PdRequestError(f"handoff_id must be a string of 1..{MAX_HANDOFF_ID_CHARS} chars")
    return value


def _finish(value, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise PdRequestError(f"{name} must be null or a finish reason, got {value!r:.40}")
    return value


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


def rng_to_json(state: bytes | None) -> str | None:
    return None if state is None else base64.b64encode(state).decode("ascii")


def rng_from_json(value) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_RNG_STATE_B64_CHARS:
        raise PdRequestError("rng must be null or the base64 of a sampler state")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise PdRequestError("rng is not valid base64") from None


# --------------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class PrefillCall:
    """Router -> prefill front end: prefill `prompt`, draw the first token, hand the KV to the
    decode front end at `decode_url`."""

    handoff_id: str
    prompt: list[int]
    params: SamplingParams
    decode_url: str

    def to_json(self) -> dict[str, Any]:
        return {
            "handoff_id": self.handoff_id,
            "prompt": self.prompt,
            "params": params_to_json(self.params),
            "decode_url": self.decode_url,
        }

    @classmethod
    def from_json(cls, raw: bytes | str | dict) -> PrefillCall:
        d = _object(raw, "prefill call")
        _fields(d, "prefill call", {"handoff_id", "prompt", "params", "decode_url"})
        url = d["decode_url"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise PdRequestError("decode_url must be an http(s) URL")
        return cls(
            _handoff_id(d["handoff_id"]),
            _ints(d["prompt"], "prompt"),
            params_from_json(d["params"]),
            url,
        )


@dataclass(frozen=True)
class KvReceipt:
    """Where a handed-off KV package waits in the decode front end's inbox (the sending
    client's id and the package's tag), and what sending it took."""

    client_id: int
    tag: int
    bytes: int
    transfer_s: float
    transport: str  # the transport the decode front end was reached over: "shm" or "nixl"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d) -> KvReceipt:
        if not isinstance(d, dict):
            raise PdRequestError("prefill answer: kv must be null or an object")
        _fields(d, "prefill answer's kv", {"client_id", "tag", "bytes", "transfer_s", "transport"})
        if not isinstance(d["transport"], str):
            raise PdRequestError("kv.transport must be a string")
        return cls(
            _int(d["client_id"], "kv.client_id"),
            _int(d["tag"], "kv.tag"),
            _int(d["bytes"], "kv.bytes"),
            _number(d["transfer_s"], "kv.transfer_s"),
            d["transport"],
        )


@dataclass(frozen=True)
class PrefillAnswer:
    """Prefill front end -> router: the first token; when it did not end the request (`finish`
    None), where its KV package went (`kv`) and the sampler's state after the draw (`rng`, the
    raw bytes of a torch generator state; None for greedy)."""

    token: int
    finish: str | None
    kv: KvReceipt | None
    rng: bytes | None
    prefill_s: float
    cached_tokens: int

    def __post_init__(self):
        if self.finish is None and self.kv is None:
            raise PdRequestError("prefill answer: an unfinished request must carry kv")

    def to_json(self) -> dict[str, Any]:
        return {
            "token": self.token,
            "finish": self.finish,
            "kv": None if self.kv is None else self.kv.to_json(),
            "rng": rng_to_json(self.rng),
            "prefill_s": self.prefill_s,
            "cached_tokens": self.cached_tokens,
        }

    @classmethod
    def from_json(cls, raw: bytes | str | dict) -> PrefillAnswer:
        d = _object(raw, "prefill answer")
        _fields(d, "prefill answer", {"token", "finish", "kv", "rng", "prefill_s", "cached_tokens"})
        return cls(
            _int(d["token"], "token"),
            _finish(d["finish"], "finish"),
            None if d["kv"] is None else KvReceipt.from_json(d["kv"]),
            rng_from_json(d["rng"]),
            _number(d["prefill_s"], "prefill_s"),
            _int(d["cached_tokens"], "cached_tokens"),
        )


@dataclass(frozen=True)
class DecodeCall:
    """Router -> decode front end: take the KV package (`client_id`, `tag`) from the inbox and
    generate the rest of the request after `tokens` (at least the prefill's first)."""

    handoff_id: str
    prompt: list[int]
    tokens: list[int]
    params: SamplingParams
    rng: bytes | None
    client_id: int
    tag: int

    @classmethod
    def after_prefill(cls, call: PrefillCall, answer: PrefillAnswer) -> DecodeCall:
        """The decode call that continues `call` from its prefill's `answer`."""
        if answer.kv is None:
            raise PdRequestError("prefill answer: no KV package to decode from (kv is null)")
        return cls(
            call.handoff_id,
            call.prompt,
            [answer.token],
            call.params,
            answer.rng,
            answer.kv.client_id,
            answer.kv.tag,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "handoff_id": self.handoff_id,
            "prompt": self.prompt,
            "tokens": self.tokens,
            "params": params_to_json(self.params),
            "rng": rng_to_json(self.rng),
            "kv": {"client_id": self.client_id, "tag": self.tag},
        }

    @classmethod
    def from_json(cls, raw: bytes | str | dict) -> DecodeCall:
        d = _object(raw, "decode call")
        _fields(d, "decode call", {"handoff_id", "prompt", "tokens", "params", "rng", "kv"})
        kv = d["kv"]
        if not isinstance(kv, dict) or set(kv) != {"client_id", "tag"}:
            raise PdRequestError('kv must be {"client_id": int, "tag": int}')
        return cls(
            _handoff_id(d["handoff_id"]),
            _ints(d["prompt"], "prompt"),
            _ints(d["tokens"], "tokens"),
            params_from_json(d["params"]),
            rng_from_json(d["rng"]),
            _int(kv["client_id"], "kv.client_id"),
            _int(kv["tag"], "kv.tag"),
        )


@dataclass(frozen=True)
class DecodeToken:
    """One line of a decode front end's stream: a token (`finish` set on the last)."""

    token: int
    finish: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"token": self.token, "finish": self.finish}


@dataclass(frozen=True)
class DecodeError:
    """The line that ends a failed decode stream, with the HTTP status the failure has."""

    message: str
    status: int

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "status": self.status}}


def to_line(msg: DecodeToken | DecodeError) -> bytes:
    """A stream line: the message's JSON and a newline (NDJSON)."""
    return (json.dumps(msg.to_json()) + "\n").encode()


def parse_line(line: bytes | str) -> DecodeToken | DecodeError:
    """One line of a decode stream, checked."""
    d = _object(line, "decode line")
    if "error" in d:
        _fields(d, "decode line", {"error"})
        e = d["error"]
        if not isinstance(e, dict):
            raise PdRequestError("decode line: error must be an object")
        _fields(e, "decode line's error", {"message", "status"})
        if not isinstance(e["message"], str):
            raise PdRequestError("error.message must be a string")
        return DecodeError(e["message"], _int(e["status"], "error.status", 100))
    _fields(d, "decode line", {"token", "finish"})
    return DecodeToken(_int(d["token"], "token"), _finish(d["finish"], "finish"))
