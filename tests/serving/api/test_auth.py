"""Who may call a front end (moecomm_serving.api.auth): with an API key and a deployment secret
set, every route of a real front end (OpenAI routes, the prefill/decode split's /pd routes, the
prefix-cache question, FastAPI's own pages) is refused without its credential (401) and with
the wrong one (403), accepted with it; /health and /metrics stay open; the API key never opens
a /pd route; a hand-off between guarded front ends (the prefill side calling the decode side)
works through a router holding the secret. Also /pd/cached's answers, and the CLI's refusals."""

from __future__ import annotations

import re

import httpx
import pytest
from fastapi.routing import APIRoute
from frontend_helpers import MAX_BATCH_TOKENS, MODEL_NAME
from moecomm.auth import SharedSecret
from moecomm.http_thread import HttpServer
from moecomm_serving.api.app import (
    CachedPrefixRoute,
    FrontendSettings,
    make_frontend_app,
    start_frontend,
)
from moecomm_serving.api.auth import OPEN_PATHS, Access, check_exposure, is_internal
from moecomm_serving.cli import main as cli
from moecomm_serving.disagg.router import Router, make_router_app
from moecomm_serving.disagg.routes import PdRoutes

KEY, SECRET = "client-key-0123456789", "deployment-secret-0123456789"
TIMEOUT_S = 60.0
PREFIX_CACHE_BYTES = 1 << 20
NEW = 4


def bearer(value: str) -> dict:
    return {"Authorization": f"Bearer {value}"}


@pytest.fixture(scope="module")
def guarded(model, tok):
    """A front end of role both (every /pd route) with a prefix cache, an API key and a
    deployment secret. Yields (app, URL)."""
    settings = FrontendSettings(
        MODEL_NAME, max_batch_tokens=MAX_BATCH_TOKENS, prefix_cache_bytes=PREFIX_CACHE_BYTES
    )
    access = Access(api_key=SharedSecret(KEY), deployment=SharedSecret(SECRET))
    ext = [PdRoutes("both"), CachedPrefixRoute()]
    app = make_frontend_app(model, tok, settings, ext, access)
    server = start_frontend(app)
    try:
        yield app, server.url
    finally:
        server.stop()


def routes_of(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves."""
    out = []
    for r in app.routes:
        methods = sorted(getattr(r, "methods", None) or {"GET"})
        method = "POST" if "POST" in methods else methods[0]
        out.append((method, r.path))
    return out


def call(url: str, method: str, path: str, headers: dict | None = None) -> httpx.Response:
    content = b"{}" if method == "POST" else None
    return httpx.request(method, url + path, content=content, headers=headers, timeout=TIMEOUT_S)


@pytest.mark.timeout(120)
def test_every_route_is_refused_without_its_credential_and_accepted_with_it(guarded):
    app, url = guarded
    routes = routes_of(app)
    paths = {p for _, p in routes}
    # the routes this test must cover are there (a renamed route would otherwise go untested)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/pd/cached"} <= paths
    assert {"/pd/info", "/pd/prefill", "/pd/decode"} <= paths
    assert sum(is_internal(p) for p in paths) >= 4
    for method, path in routes:
        if path in OPEN_PATHS:
            continue
        r = call(url, method, path)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["message"], path
        r = call(url, method, path, bearer("wrong-" + SECRET))
        assert r.status_code == 403, (path, r.text)
        # the deployment secret passes everywhere (the router calls a decode front end's OpenAI
        # route for a request it prefills there); what the route then says is its business
        r = call(url, method, path, bearer(SECRET))
        assert r.status_code not in (401, 403), (path, r.text)
        r = call(url, method, path, bearer(KEY))
        if is_internal(path):
            # a client's key never moves KV or starts a decode
            assert r.status_code == 403, (path, r.text)
            assert "deployment secret" in r.json()["error"]["message"]
        else:
            assert r.status_code not in (401, 403), (path, r.text)


@pytest.mark.timeout(120)
def test_health_and_metrics_stay_open(guarded):
    _, url = guarded
    for headers in (None, bearer("wrong")):
        assert httpx.get(f"{url}/health", headers=headers, timeout=TIMEOUT_S).status_code == 200
        r = httpx.get(f"{url}/metrics", headers=headers, timeout=TIMEOUT_S)
        assert r.status_code == 200 and "moecomm_" in r.text


def completion(url: str, ids: list[int], headers: dict) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": NEW, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=TIMEOUT_S)


@pytest.mark.timeout(120)
def test_a_completion_with_the_key_equals_one_with_the_deployment_secret(guarded):
    _, url = guarded
    ids = list(range(5, 30))
    a, b = completion(url, ids, bearer(KEY)), completion(url, ids, bearer(SECRET))
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    assert a.json()["choices"][0]["token_ids"] == b.json()["choices"][0]["token_ids"]
    assert completion(url, ids, {}).status_code == 401


def cached(url: str, body, headers=None) -> httpx.Response:
    return httpx.post(
        f"{url}/pd/cached", json=body, headers=headers or bearer(SECRET), timeout=TIMEOUT_S
    )


@pytest.mark.timeout(120)
def test_pd_cached_says_how_much_of_a_prompt_the_prefix_cache_holds(guarded):
    app, url = guarded
    block = app.state.frontend.engine.pool.block_tokens
    prompt = [7 + (i % 200) for i in range(2 * block + 8)]
    fresh = [9] * len(prompt)
    assert cached(url, {"prompt": prompt}).json() == {"cached_tokens": 0, "prefix_cache": True}
    assert completion(url, prompt, bearer(KEY)).status_code == 200
    # the request's full blocks are kept (prompt and generated tokens): two of the prompt's
    longer = prompt + [11] * block
    assert cached(url, {"prompt": longer}).json()["cached_tokens"] == 2 * block
    assert cached(url, {"prompt": fresh}).json()["cached_tokens"] == 0
    # asking takes nothing and counts nothing: the cache's lookups are the engine's own
    stats = app.state.frontend.engine.prefix_cache.stats
    lookups = stats.lookups
    cached(url, {"prompt": longer})
    assert stats.lookups == lookups
    for bad in ({}, {"prompt": "text"}, {"prompt": [1.5]}, {"prompt": [-1]}, {"prompt": [10**6]}):
        r = cached(url, bad)
        assert r.status_code == 400 and "prompt" in r.json()["error"]["message"], bad


@pytest.mark.timeout(120)
def test_pd_cached_without_a_prefix_cache(model, tok):
    settings = FrontendSettings(MODEL_NAME, max_batch_tokens=MAX_BATCH_TOKENS)
    server = start_frontend(make_frontend_app(model, tok, settings, [CachedPrefixRoute()]))
    try:
        r = httpx.post(f"{server.url}/pd/cached", json={"prompt": [1, 2, 3]}, timeout=TIMEOUT_S)
    finally:
        server.stop()
    assert r.json() == {"cached_tokens": 0, "prefix_cache": False}


@pytest.mark.timeout(180)
def test_a_hand_off_between_guarded_front_ends_works_through_a_router_with_the_secret(
    guarded, tok, model
):
    """The router sends the secret to the prefill side, which sends it on to the decode side
    (here one front end of role both plays both); the tokens equal the front end's own."""
    _, url = guarded
    ids = list(range(40, 80))
    want = completion(url, ids, bearer(KEY)).json()["choices"][0]["token_ids"]
    cfg = model.config

    def router(secret):
        r = Router(
            tok,
            MODEL_NAME,
            cfg.vocab_size,
            cfg.max_position_embeddings,
            [url],
            [url],
            backend_timeout_s=TIMEOUT_S,
            max_local_prefill_tokens=0,  # split every request: the hand-off is what is tested
            secret=secret,
        )
        server = HttpServer(make_router_app(r, api_key=SharedSecret(KEY)))
        return r, server, server.start()

    r, server, rurl = router(SharedSecret(SECRET))
    try:
        got = completion(rurl, ids, bearer(KEY))
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["token_ids"] == want
        assert r.router_metrics.handoffs == 1
        assert completion(rurl, ids, {}).status_code == 401
        assert completion(rurl, ids, bearer(SECRET)).status_code == 403  # the key, not the secret
    finally:
        server.stop()
    # a router with the wrong secret: a 502 naming the cause, no retry storm
    r, server, rurl = router(SharedSecret("not-the-" + SECRET))
    try:
        got = completion(rurl, ids, bearer(KEY))
        assert got.status_code == 502, got.text
        assert "refused the router's deployment secret" in got.json()["error"]["message"]
        assert sum(r.router_metrics.retries.values()) == 0
    finally:
        server.stop()


def test_access_rules_without_one_of_the_credentials():
    only_secret = Access(deployment=SharedSecret(SECRET))
    assert only_secret.refusal("/v1/completions", None) is None  # no key: the API is open
    assert only_secret.refusal("/pd/decode", None)[0] == 401
    assert only_secret.refusal("/pd/decode", f"Bearer {SECRET}") is None
    assert only_secret.refusal("/pd", None)[0] == 401
    assert only_secret.refusal("/pdx", None) is None  # not under /pd
    only_key = Access(api_key=SharedSecret(KEY))
    assert only_key.refusal("/pd/decode", None) is None  # no secret: /pd open (loopback only)
    assert only_key.refusal("/v1/models", None)[0] == 401
    assert only_key.refusal("/v1/models", "Bearer nope")[0] == 403
    assert only_key.refusal("/v1/models", f"Bearer {KEY}") is None
    assert only_key.refusal("/openapi.json", None)[0] == 401  # deny by default
    for path in OPEN_PATHS:
        assert only_key.refusal(path, None) is None and only_secret.refusal(path, None) is None
    assert not Access().enforced


def test_split_routes_beyond_loopback_need_a_secret():
    with_secret = Access(deployment=SharedSecret(SECRET))
    for host in ("127.0.0.1", "::1", "localhost"):
        check_exposure("decode", host, Access(), "frontend")
    check_exposure(None, "0.0.0.0", Access(), "frontend")  # no /pd routes to expose
    check_exposure("prefill", "0.0.0.0", with_secret, "frontend")
    with pytest.raises(
        SystemExit, match=re.escape("--host 0.0.0.0 exposes the prefill/decode routes")
    ):
        check_exposure("decode", "0.0.0.0", Access(), "frontend")


def test_the_cli_refuses_a_bad_secret_file_and_an_exposed_role(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("MOECOMM_PD_SECRET", raising=False)
    base = ["frontend", "--checkpoint", str(tiny_dir), "--local-experts", "--port", "0"]
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(SystemExit, match=re.escape(f"--pd-secret-file: {empty} is empty")):
        cli.main([*base, "--role", "decode", "--pd-secret-file", str(empty)])
    with pytest.raises(SystemExit, match="cannot read"):
        cli.main([*base, "--pd-secret-file", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="exposes the prefill/decode routes"):
        cli.main([*base, "--role", "decode", "--host", "0.0.0.0"])
    argv = ["router", "--checkpoint", str(tiny_dir), "--prefill", "http://127.0.0.1:1"]
    with pytest.raises(SystemExit, match="--max-local-prefill-tokens must be >= 0"):
        cli.main([*argv, "--decode", "http://127.0.0.1:2", "--max-local-prefill-tokens", "-1"])


def test_api_routes_are_api_routes(guarded):
    """The routes refused above are the app's real handlers (not a catch-all answering 401)."""
    app, _ = guarded
    handlers = {r.path for r in app.routes if isinstance(r, APIRoute)}
    assert "/v1/completions" in handlers and "/pd/cached" in handlers
