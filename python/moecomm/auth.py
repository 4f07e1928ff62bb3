"""A shared secret on HTTP: where it comes from (a flag's value, an environment variable, a file)
and how a request's ``Authorization: Bearer <secret>`` is checked against it (constant time).

Every part of a deployment that must refuse strangers uses it: the expert servers' control
planes (``--token``), the membership monitor (``$MOECOMM_MONITOR_TOKEN``), the front ends' and
the router's internal routes and API keys (``moecomm_serving.api.auth``). The secret itself is
never printed: :class:`SharedSecret`'s ``repr`` hides it, and an error names where it came from,
not what it is.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets

from moecomm.errors import MoecommError

# Bytes of a secret generate() makes: 256 bits, as `openssl rand -hex 32`.
GENERATED_BYTES = 32
# The scheme of the Authorization header (RFC 6750); compared without regard to case.
BEARER = "bearer"
# A secret longer than this is refused: an HTTP header of kilobytes is a mistake (a file of
# something else given as the secret file), and it bounds the compare.
MAX_SECRET_CHARS = 4096


class SecretError(MoecommError, ValueError):
    """A secret that cannot be used: an unreadable or empty file, an empty or oversized value."""


def constant_time_equal(given: str | bytes, expected: str | bytes) -> bool:
    """``given == expected`` in a time that does not depend on where they differ."""
    a = given.encode() if isinstance(given, str) else bytes(given)
    b = expected.encode() if isinstance(expected, str) else bytes(expected)
    return hmac.compare_digest(a, b)


def bearer_token(header: str | bytes | None) -> str | None:
    """The credential of an ``Authorization: Bearer <credential>`` header value; None when the
    header is missing, empty or of another scheme."""
    if header is None:
        return None
    text = header.decode("latin-1") if isinstance(header, (bytes, bytearray)) else header
    scheme, _, credential = text.strip().partition(" ")
    if scheme.lower() != BEARER or not credential.strip():
        return None
    return credential.strip()


def read_secret_file(path: str, what: str = "secret") -> str:
    """The secret in the file at `path`, surrounding whitespace dropped; SecretError naming
    `what` and the path when the file cannot be read or holds nothing."""
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretError(f"{what}: cannot read {path}: {exc}") from None
    if not value:
        raise SecretError(f"{what}: {path} is empty")
    return value


def generate() -> str:
    """A new random secret (hex), for a deployment that starts its own processes."""
    return secrets.token_hex(GENERATED_BYTES)


class SharedSecret:
    """One secret a deployment's processes share; `source` says where it came from (for
    messages: ``"--api-key"``, ``"$MOECOMM_API_KEY"``, ``"file /etc/..."``)."""

    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str = "value"):
        if not isinstance(value, str) or not value.strip():
            raise SecretError(f"{source}: the secret is empty")
        if len(value) > MAX_SECRET_CHARS:
            raise SecretError(f"{source}: the secret is longer than {MAX_SECRET_CHARS} characters")
        if not value.isprintable():
            # it travels in an HTTP header: no line breaks, no control characters
            raise SecretError(f"{source}: the secret holds a control character")
        self._value, self.source = value, source

    @classmethod
    def resolve(
        cls,
        value: str | None = None,
        env: str | None = None,
        file: str | None = None,
        what: str = "secret",
    ) -> SharedSecret | None:
        """The secret from the first of: `value` (a flag's value), the file at `file`, the
        environment variable named `env`; None when none is set. Giving both a value and a
        file is a SecretError (which one was meant?)."""
        if value and file:
            raise SecretError(f"{what}: give the secret or a file holding it, not both")
        if value:
            return cls(value, what)
        if file:
            return cls(read_secret_file(file, what), f"{what} file {file}")
        if env and os.environ.get(env):
            return cls(os.environ[env], f"${env}")
        return None

    @property
    def value(self) -> str:
        """The secret itself (to hand to a child process or to write a header)."""
        return self._value

    def matches(self, given: str | bytes | None) -> bool:
        """Whether `given` is the secret (constant time; None never matches)."""
        return given is not None and constant_time_equal(given, self._value)

    def matches_bearer(self, header: str | bytes | None) -> bool:
        """Whether an Authorization header value is ``Bearer <the secret>``."""
        return self.matches(bearer_token(header))

    def headers(self) -> dict[str, str]:
        """The request headers that present the secret."""
        return {"Authorization": f"Bearer {self._value}"}

    def __repr__(self) -> str:
        return f"SharedSecret(<hidden>, source={self.source!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, SharedSecret) and constant_time_equal(self._value, other._value)

    __hash__ = None  # a secret is not a dict key (its hash would leak through timing)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name a server binds) is reachable from this host only: where
    a server may run without a secret."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
