"""The driver's side of pipeline stages on other hosts: connecting to a stage agent
(:mod:`moecomm.pipeline.agent`) and a handle on the stage it started there.

Liveness: a stage that dies (or whose host dies) closes its end of the control connection; the
driver sees it at end-of-file and fails the pipeline as for a local stage that exited. A stage
whose driver vanishes reads end-of-file and exits.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import socket
import struct
import time

# Seconds to connect to an agent (TCP and the token challenge): an agent on a reachable host
# answers within milliseconds; the slack covers a busy host and a SYN retransmit (1 s).
CONNECT_TIMEOUT_S = 10.0
# How often a join() on a remote stage re-checks its connection.
JOIN_POLL_S = 0.5
# TCP keepalive on every control connection, so a host that vanishes without closing its sockets
# (power loss, a cut link) is noticed in IDLE + INTERVAL * COUNT = 8 s rather than at the step
# deadline (60 s) or never by an idle peer: the probes' failure resets the connection, which both
# ends already treat as the peer gone. Keepalive only probes an idle connection; data left
# unacknowledged that long (a command sent into the void) fails it by TCP_USER_TIMEOUT instead
# of after the kernel's minutes of retransmissions.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 5, 1, 3
UNACKED_TIMEOUT_MS = 8000
# A token shorter than this is refused: it is the right to run code on the stage host.
MIN_TOKEN_BYTES = 16


def read_token(path: str) -> bytes:
    """The token in the file at `path` (surrounding whitespace dropped)."""
    try:
        with open(path, "rb") as f:
            token = f.read().strip()
    except OSError as exc:
        raise SystemExit(f"stage token: cannot read the token file: {exc}") from None
    if len(token) < MIN_TOKEN_BYTES:
        raise SystemExit(
            f"stage token: the token in {path} has {len(token)} bytes; at least "
            f"{MIN_TOKEN_BYTES} are needed (e.g. `openssl rand -hex 32 > {path}`)"
        )
    return token


def parse_address(addr: str) -> tuple[str, int]:
    """``host:port`` -> (host, port), with a clear error for anything else."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a stage host must be HOST:PORT, got {addr!r}")
    return host, int(port)


def _io_timeout(sock: socket.socket, seconds: float) -> None:
    """Sets the kernel's send and receive timeouts of `sock` (0: none)."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def keep_alive(fd: int) -> None:
    """Turns on TCP keepalive and the unacknowledged-data timeout (the constants above) on the
    socket `fd`."""
    s = socket.socket(fileno=os.dup(fd))
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, UNACKED_TIMEOUT_MS)
    finally:
        s.close()  # the duplicate only: the options belong to the socket itself


class RemoteStage:
    """The driver's handle on a stage that runs under an agent: quacks like the
    multiprocessing.Process of a local stage where the driver needs it (pid, exitcode,
    is_alive, join), with the stage's liveness read off its control connection."""

    remote = True

    def __init__(self, address: str, conn: mpc.Connection):
        self.address = address
        self.conn = conn
        self.pid: int | None = None  # the stage's pid on its own host (from its hello)
        self.host = address
        self.exitcode: int | None = None
        # A second socket object on the connection's descriptor, only to peek at it.
        self._peek = socket.socket(fileno=os.dup(conn.fileno()))

    def poll_gone(self) -> bool:
        """Whether the stage's end of the connection is closed (it exited, or its host went)."""
        if self.exitcode is not None:
            return True
        try:
            data = self._peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:  # reset by the peer's kernel, or closed here
            data = b""
        if data == b"":
            # No exit status crosses hosts; -1 stands for "gone, status unknown".
            self.exitcode = -1
            return True
        return False

    def is_alive(self) -> bool:
        return not self.poll_gone()

    def join(self, timeout: float | None = None) -> None:
        """Waits up to `timeout` for the connection to close (messages still on it are
        dropped: whoever joins a stage is done with it)."""
        deadline = time.monotonic() + (timeout or 0.0)
        while not self.poll_gone():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            with contextlib.suppress(EOFError, OSError):
                if self.conn.poll(min(remaining, JOIN_POLL_S)):
                    self.conn.recv()

    def kill(self) -> None:
        """Closes the control connection: the stage reads end-of-file and exits."""
        with contextlib.suppress(OSError):
            self._peek.shutdown(socket.SHUT_RDWR)
        self.close()
        if self.exitcode is None:
            self.exitcode = -1

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._peek.close()
        with contextlib.suppress(OSError):
            self.conn.close()

    def describe(self) -> str:
        return f"on {self.address}" + (f" (pid {self.pid} there)" if self.pid else "")


def start_remote(address: str, token: bytes, spec) -> RemoteStage:
    """Connects to the agent at `address` and starts the stage `spec` there."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    except OSError as exc:
        raise ConnectionError(f"cannot reach the stage agent at {address}: {exc}") from None
    # The token challenge runs on the blocking descriptor (as mpc.Client's does); a kernel
    # timeout bounds it against an agent that accepts but never answers. No process-wide
    # default timeout: the front end's other threads open sockets meanwhile.
    sock.setblocking(True)
    _io_timeout(sock, CONNECT_TIMEOUT_S)
    conn = mpc.Connection(sock.detach())
    try:
        mpc.answer_challenge(conn, token)
        mpc.deliver_challenge(conn, token)
    except mp.AuthenticationError:
        conn.close()
        raise ConnectionError(
            f"the stage agent at {address} refused the token (the driver and the agent must "
            "share one)"
        ) from None
    except (OSError, EOFError) as exc:
        conn.close()
        raise ConnectionError(
            f"the stage agent at {address} did not complete the token challenge: {exc!r}"
        ) from None
    with socket.socket(fileno=os.dup(conn.fileno())) as dup:
        _io_timeout(dup, 0.0)  # from now on the driver waits with poll() and its own deadlines
    keep_alive(conn.fileno())
    stage = RemoteStage(address, conn)
    try:
        conn.send(("start", spec))
    except OSError as exc:
        stage.close()
        raise ConnectionError(
            f"the stage agent at {address} dropped the connection: {exc}"
        ) from None
    return stage
