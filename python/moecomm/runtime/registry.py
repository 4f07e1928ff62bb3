"""The clients of an expert server: one channel per client id, bound to a session secret that the
server issues at connect. A connect never hands one live client's slots to another: taking over
an id needs the secret of its session (a reconnect of the same client), or the old holder must be
dead (a restarted client reusing its id); anything else is refused."""

from __future__ import annotations

import hmac
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

from moecomm.errors import MoecommError
from moecomm.wire.server import ServerChannel
from moecomm.wire.shm import reap_stale_segments

# 128 random bits: a session secret cannot be guessed by another client.
SESSION_BYTES = 16


def new_session_secret() -> str:
    """A fresh session secret, issued at connect (hex, 2 * SESSION_BYTES characters)."""
    return secrets.token_hex(SESSION_BYTES)


def same_session(given: str, secret: str) -> bool:
    """`given` is `secret`, compared in constant time (a reply's timing tells nothing); as
    bytes, because compare_digest refuses a str with non-ASCII characters (a bad request)."""
    return hmac.compare_digest(given.encode(), secret.encode())


class ClientIdInUseError(MoecommError, ValueError):
    """A connect asked for the id of another live client without its session secret."""


class UnknownSessionError(MoecommError, ValueError):
    """A disconnect named a client id with a session secret that is not the current one."""


@dataclass
class Session:
    client_id: int
    secret: str
    channel: ServerChannel


class ClientRegistry:
    def __init__(self, server_id: str):
        self.server_id = server_id
        self._sessions: dict[int, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def ids(self) -> list[int]:
        with self._lock:
            return list(self._sessions)

    def channels(self) -> list[ServerChannel]:
        with self._lock:
            return [s.channel for s in self._sessions.values()]

    def _may_replace(self, old: Session | None, session: str) -> bool:
        if old is None or (session and same_session(session, old.secret)):
            return True
        return not old.channel.transport.peer_alive(old.channel.client)

    def admit(self, client_id: int, session: str, make_channel: Callable[[], ServerChannel]):
        """Returns the new Session. `session` is the secret of a previous connect of this client
        ("" for a first connect). Raises ClientIdInUseError when another live client holds the
        id."""
        with self._lock:
            old = self._sessions.get(client_id)
        if not self._may_replace(old, session):
            raise ClientIdInUseError(
                f"{self.server_id}: client id {client_id} belongs to another live client; "
                "pick another id (the default is random) or reconnect with its session"
            )
        channel = make_channel()
        new = Session(client_id, new_session_secret(), channel)
        with self._lock:
            current = self._sessions.get(client_id)
            if current is not old:  # a concurrent connect won the id meanwhile
                channel.close()
                raise ClientIdInUseError(
                    f"{self.server_id}: client id {client_id} was connected concurrently"
                )
            self._sessions[client_id] = new
        if old is not None:
            old.channel.announce_offline()
            old.channel.close()
        return new

    def remove(self, client_id: int, session: str | None = None) -> bool:
        """Frees the slots of `client_id`. With `session`, only if it is the current one."""
        with self._lock:
            old = self._sessions.get(client_id)
            if old is None:
                return False
            if session is not None and not same_session(session, old.secret):
                raise UnknownSessionError(
                    f"{self.server_id}: client id {client_id} is connected under another session"
                )
            del self._sessions[client_id]
        # A client that is alive after all (its lease lapsed while it was stopped, or an
        # operator dropped it) sees OFFLINE at its next wait and reconnects at once.
        old.channel.announce_offline()
        old.channel.mark_offline()
        old.channel.close()
        return True

    def drop_dead(self) -> list[int]:
        """Frees the slots of every client whose process died; returns their ids."""
        with self._lock:
            dead = [
                cid
                for cid, s in self._sessions.items()
                if not s.channel.transport.peer_alive(s.channel.client)
            ]
        dropped = [cid for cid in dead if self.remove(cid)]
        if dropped:
            reap_stale_segments()
        return dropped

    def close_all(self) -> None:
        """The server stops: tell every client at once (they fail over instead of waiting for a
        deadline), then free the slots."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            s.channel.announce_offline()
            s.channel.mark_offline()
            s.channel.close()
