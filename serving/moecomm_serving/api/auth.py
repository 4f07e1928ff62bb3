"""Who may call a front end's or the router's routes (docs/frontend.md, "Access").

Two credentials, both sent as ``Authorization: Bearer <credential>`` and checked in constant
time (:class:`moecomm.auth.SharedSecret`):

- the **API key** (``--api-key``, ``$MOECOMM_API_KEY``): the clients' key for the OpenAI routes,
  as vLLM's and SGLang's ``--api-key``. With a key set, every route but ``/health`` and
  ``/metrics`` needs it (deny by default: a route added later is not open by mistake);
- the **deployment secret** (``--pd-secret-file``, ``$MOECOMM_PD_SECRET``): what the router and
  the front ends of one deployment share. The prefill/decode split's internal routes (``/pd/``:
  the prefill, the decode, the KV handshake, the prefix-cache question) take it and nothing
  else — a client's API key never moves KV or starts a decode. It is accepted wherever the API
  key is (the router calls a decode front end's OpenAI route for a request it prefills there).

A refusal happens before the body is read or any route runs, in the OpenAI error shape: 401
without a credential, 403 with a wrong one. Without a key, the OpenAI routes are open; without a
deployment secret, ``/pd/`` is open (a front end with a role refuses to listen beyond loopback
without one: :func:`check_exposure`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from moecomm.auth import SharedSecret, is_loopback

from moecomm_serving.api import openai as oa

API_KEY_ENV = "MOECOMM_API_KEY"
PD_SECRET_ENV = "MOECOMM_PD_SECRET"
# Routes that stay open whatever is set: load balancers and Prometheus call them without keys
# (as vLLM's and SGLang's --api-key leave /health and /metrics open).
OPEN_PATHS = frozenset({"/health", "/metrics"})
# The split's internal routes (moecomm_serving.disagg.routes) and the prefix-cache question.
INTERNAL_PREFIX = "/pd"


def is_internal(path: str) -> bool:
    """Whether `path` is one of the deployment's internal routes (``/pd`` and below)."""
    return path == INTERNAL_PREFIX or path.startswith(INTERNAL_PREFIX + "/")


@dataclass(frozen=True)
class Access:
    """The credentials a server takes: `api_key` for its OpenAI routes (None: open),
    `deployment` for its internal routes (None: open)."""

    api_key: SharedSecret | None = None
    deployment: SharedSecret | None = None

    def refusal(self, path: str, authorization: bytes | str | None) -> tuple[int, str] | None:
        """(status, message) when a request for `path` with this Authorization header value
        must be refused; None when it may go on."""
        if path in OPEN_PATHS:
            return None
        if is_internal(path):
            if self.deployment is None or self.deployment.matches_bearer(authorization):
                return None
            if not authorization:
                return 401, (
                    f"{path} is internal to the deployment: send its shared secret as "
                    "'Authorization: Bearer <secret>' (--pd-secret-file or "
                    f"${PD_SECRET_ENV})"
                )
            return 403, f"{path}: the deployment secret given is not this server's"
        if self.api_key is None:
            return None
        if self.api_key.matches_bearer(authorization):
            return None
        if self.deployment is not None and self.deployment.matches_bearer(authorization):
            return None
        if not authorization:
            return 401, f"{path} needs an API key: send 'Authorization: Bearer <key>'"
        return 403, "the API key given is not valid"

    @property
    def enforced(self) -> bool:
        return self.api_key is not None or self.deployment is not None


class AccessGuard:
    """Plain ASGI middleware applying an :class:`Access` to every HTTP request (cheaper than
    ``@app.middleware``'s wrapper, which every streamed token would pass through)."""

    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    header = value
                    break
            refused = self.access.refusal(scope["path"], header)
            if refused is not None:
                status, message = refused
                body = oa.ApiError(status, message).body()
                response = JSONResponse(body, status, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def install_access(app: FastAPI, access: Access | None) -> None:
    """Puts `access` in front of every route of `app` (nothing when None or nothing is set)."""
    if access is not None and access.enforced:
        app.add_middleware(AccessGuard, access=access)


def check_exposure(role: str | None, host: str, access: Access, command: str) -> None:
    """SystemExit when a server with the split's internal routes (`role` set, or the router)
    would listen beyond loopback without a deployment secret: anyone reaching its port could
    start decodes and move KV."""
    if role is not None and access.deployment is None and not is_loopback(host):
        raise SystemExit(
            f"moecomm {command}: --host {host} exposes the prefill/decode routes beyond this "
            f"host: give the deployment's shared secret (--pd-secret-file or ${PD_SECRET_ENV})"
        )
