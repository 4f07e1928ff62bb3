"""An ASGI app served by uvicorn from a background thread.

The expert server's control plane, the membership monitor and the serving frontend each run
beside other work in one process (the expert loop, a test, the engine); this is the one place
that starts such a server, waits for it to listen and stops it. Binds loopback unless told
otherwise.
"""

from __future__ import annotations

import threading
import time

import uvicorn

DEFAULT_HOST = "127.0.0.1"
# Binding a socket and starting the event loop takes milliseconds; this only bounds a server
# that cannot bind (port in use) or whose thread died, on a loaded CI machine.
START_TIMEOUT_S = 30.0
# How long stop() waits for the thread after asking uvicorn to exit (open connections close).
STOP_TIMEOUT_S = 10.0
# Poll period while waiting for uvicorn to report it listens.
_START_POLL_S = 0.01


class HttpServer:
    """`app` served on `host`:`port` (0: any free port) from a daemon thread. ``start()``
    returns the URL it listens on (also kept in ``.url``). `what` names the server in the error
    raised when it does not start; `graceful_shutdown_s` cuts requests still open at ``stop()``
    (long-polls) after that many seconds."""

    def __init__(
        self,
        app,
        host: str = DEFAULT_HOST,
        port: int = 0,
        *,
        what: str = "the HTTP control plane",
        thread_name: str | None = None,
        graceful_shutdown_s: float | None = None,
    ):
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=graceful_shutdown_s,
        )
        self.what = what
        self.url = ""
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=thread_name, daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{self.what} did not start")
            time.sleep(_START_POLL_S)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
