"""The stage host agent: runs pipeline stages for drivers on other hosts.

On each host that should run stages:

    python -m moecomm.pipeline.agent --host 10.0.0.2 --port 7400 --token-file /etc/moecomm/stage.key

It listens on TCP. A driver (``Pipeline(stage_hosts=[...])``; ``moecomm frontend --stages N
--stage-hosts ...``) connects, proves it holds the same token (multiprocessing's HMAC challenge,
both ways, before a single object is unpickled: a peer without the token never gets to send
one), and sends the stage's :class:`~moecomm.pipeline.stage.StageSpec`. The agent starts the stage
as a child process and hands it the connection, which is from then on the stage's control
channel, exactly what a pipe is for a local stage; the agent goes back to accepting (a restarted
pipeline, or its standby, connects again). The spec carries the stage's factory, so the token is
the right to run code on this host: keep it as secret as an SSH key, and listen on a private
network. The driver's side is :mod:`moecomm.pipeline.remote`.

Killing the agent takes its host's stages down with it (a stage exits when its parent is gone),
as losing the host would; SIGTERM stops them first.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import socket
import sys
import time

from moecomm.pipeline.remote import CONNECT_TIMEOUT_S, keep_alive, read_token
from moecomm.readiness import announce_ready

log = logging.getLogger("moecomm.pipeline.agent")

# How long a stopping agent gives its stages to exit after SIGTERM before it kills them.
STOP_GRACE_S = 2.0


def _serve_one(ctx, conn: mpc.Connection, host: str | None):
    """Starts the stage a driver sent over `conn`; returns its process (None: refused)."""
    from moecomm.pipeline.stage import StageSpec, stage_main

    keep_alive(conn.fileno())
    if not conn.poll(CONNECT_TIMEOUT_S):
        log.warning("stage agent: a driver connected but sent nothing")
        return None
    msg = conn.recv()
    if not (isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "start"):
        log.warning("stage agent: expected a start message, got %.100r", msg)
        return None
    spec = msg[1]
    if not isinstance(spec, StageSpec):
        log.warning("stage agent: the start message carries no StageSpec")
        return None
    # nixl carries the stage's bytes over the interface the agent listens on.
    if host and host != "0.0.0.0":
        spec = dataclasses.replace(spec, host=host)
    p = ctx.Process(target=stage_main, args=(spec, conn), daemon=False)
    p.start()
    log.info("stage agent: stage %d of %d started (pid %d)", spec.index, spec.num_stages, p.pid)
    return p


def serve(host: str, port: int, token: bytes, ready=None) -> None:
    """Accepts drivers until SIGTERM / SIGINT; each connection becomes one stage process."""
    ctx = mp.get_context("spawn")
    listener = mpc.Listener((host, port), family="AF_INET", authkey=token)
    children: list = []
    stopping = []

    def stop(signum, frame):
        stopping.append(signum)
        # Wakes the accept() below (a signal alone restarts it).
        with contextlib.suppress(OSError):
            listener._listener._socket.shutdown(socket.SHUT_RDWR)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    port = listener.address[1]
    print(f"stage agent listening on {host}:{port}", flush=True)
    announce_ready("stage-agent", address=f"{host}:{port}", host=host, port=port)
    if ready is not None:
        ready()
    try:
        while not stopping:
            children = [c for c in children if c.exitcode is None]
            try:
                conn = listener.accept()
            except mp.AuthenticationError as exc:
                log.warning("stage agent: a connection without the token: %s", exc)
                continue
            except OSError:
                if stopping:
                    break
                raise
            try:
                p = _serve_one(ctx, conn, host)
            except Exception as exc:  # a bad driver must not take the agent down
                log.warning("stage agent: could not start a stage: %s", exc)
                p = None
            if p is not None:
                children.append(p)
            conn.close()  # the child holds its own copy
    finally:
        with contextlib.suppress(OSError):
            listener.close()
        deadline = time.monotonic() + STOP_GRACE_S
        for c in children:
            if c.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.pid, signal.SIGTERM)
        for c in children:
            c.join(max(0.0, deadline - time.monotonic()))
            if c.exitcode is None:
                c.kill()
                c.join(STOP_GRACE_S)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The agent's options (`python -m moecomm.pipeline.agent` and `moecomm stage-agent`)."""
    ap.add_argument("--host", required=True, help="address to listen on (and carry nixl over)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument(
        "--token-file",
        required=True,
        help="file holding the token drivers must prove (at least 16 bytes; the right to run "
        "code here)",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    serve(args.host, args.port, read_token(args.token_file))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m moecomm.pipeline.agent",
        description="Runs pipeline stages for drivers on other hosts (moecomm frontend "
        "--stages N --stage-hosts HOST:PORT,...).",
    )
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
