"""What a member is, what a watcher hears, and the bounds every backend enforces on both.

A member is identified by (role, member_id). Its record adds what the backend needs to track it:
the lease TTL and an `incarnation` — a random string chosen once per `Registration`, so that a
re-registration by the same process (after the backend forgot it) can be told apart from a new
process that took the same id (whose peers must treat the old one as lost)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from moecomm.errors import MoecommError

# How long watch() waits for the first snapshot before it says the backend cannot be reached.
WATCH_START_TIMEOUT_S = 10.0


class MembershipError(MoecommError):
    """The membership backend refused a request or answered something we cannot use."""


class SupersededError(MembershipError):
    """Another incarnation now holds this member's (role, member_id); this one must stop."""


def monotonic_deadline(timeout: float) -> float:
    if timeout is None or timeout < 0:
        raise ValueError(f"every wait needs a deadline: timeout must be >= 0, got {timeout}")
    return time.monotonic() + timeout


# Roles and ids end up in etcd keys and URLs: a small alphabet with no "/" keeps keys parseable.
ROLE_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
MEMBER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
# Bounds on everything a member carries: generous for real deployments (a server hosting every
# expert of a 61-layer, 256-expert model fits), small enough that a bad request stays cheap.
MAX_ENDPOINTS = 16
MAX_ENDPOINT_NAME = 64
MAX_ENDPOINT_URL = 512
MAX_LAYERS = 1024
MAX_EXPERT_ID = 1 << 20
MAX_HOSTED_EXPERTS = 1 << 16
MAX_METADATA_ITEMS = 64
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 1024
MAX_INCARNATION = 64
# A lease shorter than a scheduling hiccup on a loaded 2-core machine would flap; one longer
# than an hour means a dead member holds its place for most of a serving day.
MIN_TTL_S = 0.2
MAX_TTL_S = 3600.0

EVENT_KINDS = ("join", "loss", "update")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_str_map(
    field: str, keys: str, d: Any, max_items: int, max_key: int, max_value: int, min_value: int
) -> None:
    """`d` is a dict of at most `max_items` str -> str, keys of 1..`max_key` characters, values
    of `min_value`..`max_value`; else ValueError naming `field` (its keys as `keys`)."""
    _check(
        isinstance(d, dict) and len(d) <= max_items,
        f"{field} must be a dict of at most {max_items} items",
    )
    for k, v in d.items():
        _check(
            isinstance(k, str) and 0 < len(k) <= max_key,
            f"{keys} must be 1..{max_key} characters, got {k!r}",
        )
        _check(
            isinstance(v, str) and min_value <= len(v) <= max_value,
            f"{field}[{k!r}] must be a string of {min_value}..{max_value} characters",
        )


@dataclass(frozen=True)
class Member:
    """One participant: an expert server, an attention client, a pipeline stage, ...

    `endpoints` names the URLs peers use (e.g. {"control": "http://127.0.0.1:8001"}); `experts`
    maps a layer to the expert ids this member hosts (servers only); `metadata` is free-form
    strings (capacity, device, ...)."""

    role: str
    member_id: str
    endpoints: dict[str, str] = field(default_factory=dict)
    experts: dict[int, list[int]] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.member_id)

    def validate(self) -> None:
        """Raises ValueError saying which field is wrong, what was expected and what was given."""
        _check(
            isinstance(self.role, str) and bool(ROLE_RE.match(self.role)),
            f"role must match {ROLE_RE.pattern}, got {self.role!r}",
        )
        _check(
            isinstance(self.member_id, str) and bool(MEMBER_ID_RE.match(self.member_id)),
            f"member_id must match {MEMBER_ID_RE.pattern}, got {self.member_id!r}",
        )
        # endpoints: name -> URL, never empty; metadata: free strings, empty allowed.
        _check_str_map(
            "endpoints",
            "endpoint names",
            self.endpoints,
            MAX_ENDPOINTS,
            MAX_ENDPOINT_NAME,
            MAX_ENDPOINT_URL,
            1,
        )
        _check(
            isinstance(self.experts, dict) and len(self.experts) <= MAX_LAYERS,
            f"experts must map at most {MAX_LAYERS} layers to expert ids",
        )
        total = 0
        for layer, ids in self.experts.items():
            _check(
                isinstance(layer, int) and 0 <= layer < MAX_LAYERS,
                f"expert layers must be ints in [0, {MAX_LAYERS}), got {layer!r}",
            )
            _check(
                isinstance(ids, list)
                and all(isinstance(e, int) and 0 <= e < MAX_EXPERT_ID for e in ids),
                f"layer {layer}: expert ids must be a list of ints in [0, {MAX_EXPERT_ID})",
            )
            total += len(ids)
        _check(
            total <= MAX_HOSTED_EXPERTS,
            f"at most {MAX_HOSTED_EXPERTS} hosted experts per member, got {total}",
        )
        _check_str_map(
            "metadata",
            "metadata keys",
            self.metadata,
            MAX_METADATA_ITEMS,
            MAX_METADATA_KEY,
            MAX_METADATA_VALUE,
            0,
        )

    def to_dict(self) -> dict[str, Any]:
        # JSON object keys are strings: layers travel as "0", "1", ... and come back as ints.
        return {
            "role": self.role,
            "member_id": self.member_id,
            "endpoints": dict(self.endpoints),
            "experts": {str(layer): list(ids) for layer, ids in self.experts.items()},
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Member:
        if not isinstance(d, dict):
            raise ValueError(f"a member must be a JSON object, got {type(d).__name__}")
        experts = d.get("experts") or {}
        if not isinstance(experts, dict):
            raise ValueError("experts must be an object mapping layers to expert id lists")
        try:
            experts = {int(layer): ids for layer, ids in experts.items()}
        except (TypeError, ValueError) as exc:
            raise ValueError(f"expert layers must be integers: {exc}") from None
        return cls(
            role=d.get("role"),
            member_id=d.get("member_id"),
            endpoints=d.get("endpoints") or {},
            experts=experts,
            metadata=d.get("metadata") or {},
        )


def check_ttl(ttl: float) -> float:
    ttl = float(ttl)
    _check(
        MIN_TTL_S <= ttl <= MAX_TTL_S,
        f"ttl must be in [{MIN_TTL_S}, {MAX_TTL_S}] seconds, got {ttl}",
    )
    return ttl


@dataclass(frozen=True)
class Record:
    """A member as a backend stores it: with its lease TTL and the incarnation that holds it."""

    member: Member
    ttl: float
    incarnation: str
    leaving: bool = False  # set just before a graceful deregistration (etcd; see docs)

    def to_dict(self) -> dict[str, Any]:
        d = {"member": self.member.to_dict(), "ttl": self.ttl, "incarnation": self.incarnation}
        if self.leaving:
            d["leaving"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        if not isinstance(d, dict):
            raise ValueError(f"a member record must be a JSON object, got {type(d).__name__}")
        inc = d.get("incarnation")
        _check(
            isinstance(inc, str) and 0 < len(inc) <= MAX_INCARNATION,
            f"incarnation must be 1..{MAX_INCARNATION} characters",
        )
        return cls(Member.from_dict(d.get("member")), float(d["ttl"]), inc, bool(d.get("leaving")))


@dataclass(frozen=True)
class Event:
    """What a watcher hears.

    kind: "join" (a member appeared, or came back as a new incarnation), "loss" (its lease
    expired, it deregistered, or it was replaced by a new incarnation of the same id), "update"
    (same incarnation re-registered with different endpoints/experts/metadata).
    reason: a short word saying why: "registered", "expired", "deregistered", "replaced",
    "updated", "existing" (present when the watch started), "not re-registered" (absent after
    the backend restarted and did not come back within one TTL), "missing" (gone after a resync).
    """

    kind: str
    member: Member
    reason: str = ""
    incarnation: str = ""

    def __post_init__(self) -> None:
        _check(self.kind in EVENT_KINDS, f"event kind must be one of {EVENT_KINDS}")
