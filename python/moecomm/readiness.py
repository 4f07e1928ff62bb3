"""The readiness signal of a moecomm process: a small JSON file it writes once it serves.

Whoever starts a moecomm process (a test, a benchmark, `moecomm demo`, a launcher) and wants to
know when it serves names a file in the child's environment (``MOECOMM_READY_FILE``). Once the
process serves, it writes that file with :func:`announce_ready`: one JSON object holding its
``role``, its ``pid`` and what a caller needs to reach it (``url``, or ``address`` for a raw
socket), plus anything role-specific (an expert server's ``layers`` and ``experts``). The file
appears whole or not at all (written beside itself, then renamed), so a reader never parses half
of it. The "listening on" lines the processes print stay, for people; nothing parses them.

Processes started with ``multiprocessing`` by the library itself (``runtime.launch.spawn_ready``)
say they are ready over their pipe instead: the pipe is also their control channel.

Standard library only: the membership monitor, a light process, imports this.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

READY_FILE_ENV = "MOECOMM_READY_FILE"


def announce_ready(role: str, **fields) -> dict | None:
    """Writes this process's ready file, if its starter asked for one (``$MOECOMM_READY_FILE``);
    returns what was written, or None when nobody asked. `fields` must be JSON-serialisable:
    ``url=...`` for an HTTP service, ``address=...`` for a socket, anything else a starter may
    read. Call it once the process serves: the starter takes the file as the signal."""
    path = os.environ.get(READY_FILE_ENV)
    if not path:
        return None
    info = {"role": role, "pid": os.getpid(), **fields}
    text = json.dumps(info, sort_keys=True)
    # Beside the target (same file system: the rename is atomic), then renamed onto it.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".ready-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return info


def read_ready(path: str | os.PathLike) -> dict | None:
    """The JSON a process announced at `path`, or None while it has not (no file yet)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        info = json.loads(text)
    except ValueError as exc:  # never half-written (see announce_ready): someone else wrote it
        raise ValueError(f"ready file {path} is not announce_ready's JSON: {exc}") from None
    if not isinstance(info, dict) or "role" not in info or "pid" not in info:
        raise ValueError(f"ready file {path} lacks role/pid: {text[:200]!r}")
    return info
