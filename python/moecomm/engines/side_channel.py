"""A side channel for engine plug-ins: one length-prefixed JSON request and its answer per TCP
connection, with an optional shared token. The vLLM KV connector's prefill worker listens on one
(``info``: its pools; ``pull``: a decode's transfer requests) and its decode asks it. Engine-free:
importing it needs no engine."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading

from moecomm.auth import constant_time_equal
from moecomm.wire.kv import BlockTransferError

logger = logging.getLogger(__name__)

# The side channel carries small JSON (pool descriptions, block lists): a message above this is
# malformed, not big.
MAX_MESSAGE_BYTES = 16 << 20
# Connecting to and answering on the side channel: a healthy peer answers in milliseconds; a
# silent one must not hold a decode step longer than this.
SIDE_CHANNEL_TIMEOUT_S = 5.0
_LEN = struct.Struct("!I")


def send_msg(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise BlockTransferError("moecomm side channel: the peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE_BYTES:
        raise BlockTransferError(
            f"moecomm side channel: a {n}-byte message (max {MAX_MESSAGE_BYTES})"
        )
    try:
        obj = json.loads(_recv_exact(sock, n))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BlockTransferError(f"moecomm side channel: malformed message ({exc})") from None
    if not isinstance(obj, dict):
        raise BlockTransferError("moecomm side channel: a message must be a JSON object")
    return obj


def ask(host: str, port: int, message: dict, timeout: float = SIDE_CHANNEL_TIMEOUT_S) -> dict:
    """One request/answer on a prefill worker's side channel; raises BlockTransferError when
    it refuses, and OSError when it cannot be reached."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        send_msg(sock, message)
        answer = recv_msg(sock)
    if not answer.get("ok"):
        raise BlockTransferError(
            f"moecomm side channel {host}:{port} refused {message.get('op')!r}: "
            f"{answer.get('error', 'no reason given')}"
        )
    return answer


class Listener:
    """The prefill worker's side channel: answers ``info`` (its pools) and takes ``pull``
    orders (a decode's transfer requests), one JSON message per connection."""

    def __init__(self, host: str, port: int, token: str, on_pull, pools: list[str]):
        self.token = token
        self.on_pull = on_pull
        self.pools = pools
        self.sock = socket.create_server((host, port))
        self.sock.settimeout(0.5)  # the accept loop's check of `stopping`
        self.port = self.sock.getsockname()[1]
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="moecomm-kv-listener", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(SIDE_CHANNEL_TIMEOUT_S)
                try:
                    msg = recv_msg(conn)
                    send_msg(conn, self._answer(msg))
                except (OSError, BlockTransferError) as exc:
                    logger.warning("moecomm kv side channel: dropped a connection: %s", exc)

    def _answer(self, msg: dict) -> dict:
        given = str(msg.get("token", ""))
        if self.token and not constant_time_equal(given, self.token):
            return {"ok": False, "error": "bad or missing token"}
        op = msg.get("op")
        if op == "info":
            return {"ok": True, "pools": self.pools}
        if op == "pull":
            try:
                self.on_pull(msg)
            except (BlockTransferError, KeyError, TypeError, ValueError) as exc:
                return {"ok": False, "error": str(exc)}
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def close(self) -> None:
        self.stopping.set()
        self.sock.close()
        self.thread.join(timeout=2.0)
