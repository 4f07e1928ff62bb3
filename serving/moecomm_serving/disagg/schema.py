"""The messages of the prefill/decode split's internal routes (docs/router.md), each defined
once and used by both of its ends: what a router sends a prefill front end
(:class:`PrefillCall`, ``POST /pd/prefill``) and what it answers (:class:`PrefillAnswer`), what
the prefill front end asks the decode front end before it writes the KV there
(:class:`ReserveCall`, ``POST /pd/reserve``: the cache's metadata and the sender's KV pool) and
what it answers (:class:`ReserveAnswer`: the receiver's pool and the transfer's destination
blocks), what the router then sends the decode front end (:class:`DecodeCall`,
``POST /pd/decode``) and the lines that stream back (:class:`DecodeToken`,
:class:`DecodeError`).

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

from moecomm_serving.types import KvPackage, SamplingParams

# A router's id of one attempt; bounded so a hostile body cannot make every log line huge.
MAX_HANDOFF_ID_CHARS = 64
# The sampler state of torch's CPU generator (mt19937) is 5,056 bytes; base64 of a state
# beyond this is not one.
MAX_RNG_STATE_B64_CHARS = 16384
# A KV pool's description (moecomm.wire.kv.KvPoolInfo JSON: handles and a layout of a few parts
# per layer) and a transfer request (a list of block ids): far below this for any real model;
# the pool code checks their contents, this only bounds what a body may make us parse.
MAX_KV_JSON_CHARS = 8 << 20
# A cache's metadata lists its layers; no model has more (moecomm.wire.kv.MAX_LAYERS).
MAX_KV_LAYERS = 1024
MAX_DTYPE_CHARS = 32
# How the KV of a hand-off moves when both front ends share a host: pool to pool over shm.
POOL_TRANSPORT = "shm"
MAX_TRANSPORT_CHARS = 16
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


def package_to_json(p: KvPackage) -> dict[str, Any]:
    return p.meta()


def package_from_json(d) -> KvPackage:
    """A cache's metadata, with every field's type checked (whether it fits a pool is
    :func:`moecomm_serving.kv.blocks.check_package`'s question, asked once by the receiver)."""
    if not isinstance(d, dict):
        raise PdRequestError("kv must be an object (the cache's metadata)")
    _fields(d, "kv", {"version", "length", "block_tokens", "layers", "kv_shape", "dtype"})
    layers = d["layers"]
    if not isinstance(layers, list) or not 0 < len(layers) <= MAX_KV_LAYERS:
        raise PdRequestError(f"kv.layers must be a list of 1..{MAX_KV_LAYERS} layer ids")
    shape = d["kv_shape"]
    if not isinstance(shape, list) or len(shape) != 3:
        raise PdRequestError("kv.kv_shape must be [heads, key width, value width]")
    dtype = d["dtype"]
    if not isinstance(dtype, str) or not 0 < len(dtype) <= MAX_DTYPE_CHARS:
        raise PdRequestError("kv.dtype must be an element type's name")
    return KvPackage(
        version=_int(d["version"], "kv.version"),
        length=_int(d["length"], "kv.length", 1),
        block_tokens=_int(d["block_tokens"], "kv.block_tokens", 1),
        layers=tuple(_int(x, "kv.layers") for x in layers),
        kv_shape=tuple(_int(x, "kv.kv_shape", 1) for x in shape),
        dtype=dtype,
    )


def _kv_json(value, name: str) -> str:
    """A JSON document of moecomm.wire.kv (a pool's info, a transfer request), as the string
    its own parser reads."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_KV_JSON_CHARS:
        raise PdRequestError(f"{name} must be a JSON string of at most {MAX_KV_JSON_CHARS} chars")
    return value


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
class ReserveCall:
    """Prefill front end -> decode front end, before any KV byte moves: reserve blocks for a
    cache described by `kv` (checked once, there), to be written from the KV pool `pool` (its
    :class:`moecomm.wire.kv.KvPoolInfo` JSON), for the router's hand-off `handoff_id`."""

    handoff_id: str
    kv: KvPackage
    pool: str
    pool_nixl: str | None = None  # the same memory registered with nixl, for another host

    def to_json(self) -> dict[str, Any]:
        d = {"handoff_id": self.handoff_id, "kv": package_to_json(self.kv), "pool": self.pool}
        if self.pool_nixl is not None:
            d["pool_nixl"] = self.pool_nixl
        return d

    @classmethod
    def from_json(cls, raw: bytes | str | dict) -> ReserveCall:
        d = _object(raw, "reserve call")
        _fields(d, "reserve call", {"handoff_id", "kv", "pool"}, frozenset({"pool_nixl"}))
        nixl = d.get("pool_nixl")
        return cls(
            _handoff_id(d["handoff_id"]),
            package_from_json(d["kv"]),
            _kv_json(d["pool"], "pool"),
            None if nixl is None else _kv_json(nixl, "pool_nixl"),
        )


@dataclass(frozen=True)
class ReserveAnswer:
    """Decode front end -> prefill front end: its KV pool (`pool`, KvPoolInfo JSON) and the
    transfer to write (`request`, :class:`moecomm.wire.kv.KvTransferRequest` JSON: the
    destination blocks, the completion slot and the transfer's sequence number)."""

    pool: str
    request: str

    def to_json(self) -> dict[str, Any]:
        return {"pool": self.pool, "request": self.request}

    @classmethod
    def from_json(cls, raw: bytes | str | dict) -> ReserveAnswer:
        d = _object(raw, "reserve answer")
        _fields(d, "reserve answer", {"pool", "request"})
        return cls(_kv_json(d["pool"], "pool"), _kv_json(d["request"], "request"))


@dataclass(frozen=True)
class KvReceipt:
    """Where the handed-off KV waits on the decode front end, and what sending it took. The
    field names are the wire's since the byte mailbox it replaced (kept so that routers of
    either age read it): `client_id` is the transfer's completion slot in the decode front
    end's KV pool, `tag` the transfer's sequence number (what the decode front end finds its
    reservation by)."""

    client_id: int
    tag: int
    bytes: int
    transfer_s: float
    # the transport the decode front end's pool was written over: "shm" on one host, "nixl"
    # across hosts (its pool registered with nixl; the transfer's slot and sequence number
    # are then that pool's)
    transport: str

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
    """Router -> decode front end: continue from the KV transfer (`client_id`: its slot,
    `tag`: its sequence number, :class:`KvReceipt`) written into its pool, and generate the
    rest of the request after `tokens` (at least the prefill's first). `transport` is the
    receipt's: "shm" unless the KV came over nixl from another host (then the wire's ``kv``
    object carries ``transport`` too)."""

    handoff_id: str
    prompt: list[int]
    tokens: list[int]
    params: SamplingParams
    rng: bytes | None
    client_id: int
    tag: int
    transport: str = POOL_TRANSPORT

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
            answer.kv.transport or POOL_TRANSPORT,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "handoff_id": self.handoff_id,
            "prompt": self.prompt,
            "tokens": self.tokens,
            "params": params_to_json(self.params),
            "rng": rng_to_json(self.rng),
            "kv": {"client_id": self.client_id, "tag": self.tag}
            | ({} if self.transport == POOL_TRANSPORT else {"transport": self.transport}),
        }

    @classmethod
    def from_json(cls, raw: bytes | str | dict) -> DecodeCall:
        d = _object(raw, "decode call")
        _fields(d, "decode call", {"handoff_id", "prompt", "tokens", "params", "rng", "kv"})
        kv = d["kv"]
        if not isinstance(kv, dict) or set(kv) - {"transport"} != {"client_id", "tag"}:
            raise PdRequestError('kv must be {"client_id": int, "tag": int[, "transport": str]}')
        transport = kv.get("transport", POOL_TRANSPORT)
        if not isinstance(transport, str) or not 0 < len(transport) <= MAX_TRANSPORT_CHARS:
            raise PdRequestError("kv.transport must be a transport's name")
        return cls(
            _handoff_id(d["handoff_id"]),
            _ints(d["prompt"], "prompt"),
            _ints(d["tokens"], "tokens"),
            params_from_json(d["params"]),
            rng_from_json(d["rng"]),
            _int(kv["client_id"], "kv.client_id"),
            _int(kv["tag"], "kv.tag"),
            transport,
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
