"""`moecomm router`: the OpenAI API in front of prefill and decode front ends
(`moecomm frontend --role prefill|decode`); see docs/router.md."""

from __future__ import annotations

import argparse
import os

import httpx
from moecomm.http_thread import DEFAULT_HOST, HttpServer
from moecomm.readiness import announce_ready

from moecomm_serving.cli.common import (
    access_from_args,
    add_access_arguments,
    stop_on_signals,
    wait_for_stop,
)
from moecomm_serving.disagg.router import (
    DECODE,
    DEFAULT_AFFINITY_TOKENS,
    DEFAULT_BACKEND_TIMEOUT_S,
    DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    PREFILL,
    Router,
    make_router_app,
)
from moecomm_serving.model.config import MoEConfig
from moecomm_serving.model.tokenizer import load_tokenizer
from moecomm_serving.types import DEFAULT_REQUEST_TIMEOUT_S

# The start-up check of each front end's /pd/info: it answers from memory, so a front end that
# takes longer is not serving.
INFO_TIMEOUT_S = 10.0
# A front end of role "both" serves either side of the split (moecomm_serving.disagg.routes).
ACCEPTED_ROLES = {PREFILL: ("prefill", "both"), DECODE: ("decode", "both")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        help="HF-layout checkpoint directory (its config and tokenizer only; no weights are read)",
    )
    p.add_argument(
        "--prefill",
        required=True,
        help="prefill front ends (`moecomm frontend --role prefill`), URLs comma-separated",
    )
    p.add_argument(
        "--decode",
        required=True,
        help="decode front ends (`moecomm frontend --role decode`), URLs comma-separated",
    )
    p.add_argument(
        "--model-name",
        default=None,
        help="name served as `model` (default: the checkpoint's directory name); every front "
        "end must serve the same name",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help="HTTP address (loopback by default)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free one)")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="each request's deadline, retries included (s)",
    )
    p.add_argument(
        "--backend-timeout",
        type=float,
        default=DEFAULT_BACKEND_TIMEOUT_S,
        help="the longest a front end may stay silent (the prefill's answer, the gap between "
        "two decoded tokens) before the request moves to another one (s)",
    )
    p.add_argument(
        "--prefix-affinity-tokens",
        type=int,
        default=DEFAULT_AFFINITY_TOKENS,
        help="prompts that start with the same this many tokens go to the same prefill front "
        "end (while it is not much busier than the others), so its --prefix-cache-bytes cache "
        "sees their shared prefix (default %(default)s; 0: least loaded only)",
    )
    p.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
        help="conditional disaggregation: a prompt with at most this many tokens that the decode "
        "front end's prefix cache does not hold yet is prefilled on the decode front end, with "
        "no KV hand-off (default %(default)s, measured by bench/serving/pd.py; 0: split every "
        "request)",
    )
    add_access_arguments(p)


def parse_urls(text: str, flag: str) -> list[str]:
    """``URL,URL,...`` -> the URLs (no trailing slash); SystemExit naming the flag if the list
    is empty, has a duplicate or a URL that is not http(s)://host[:port]."""
    urls = [u.strip().rstrip("/") for u in text.split(",")]
    if not any(urls):
        raise SystemExit(f"moecomm router: {flag} needs at least one front-end URL")
    for u in urls:
        try:
            parsed = httpx.URL(u)
        except httpx.InvalidURL as exc:
            raise SystemExit(f"moecomm router: {flag}: {u!r} is not a URL ({exc})") from None
        if (
            parsed.scheme not in ("http", "https")
            or not parsed.host
            or parsed.path not in ("", "/")
        ):
            raise SystemExit(
                f"moecomm router: {flag}: {u!r} is not a front end's base URL "
                "(http://host:port, comma-separated, no empty entries)"
            )
    if len(set(urls)) != len(urls):
        raise SystemExit(f"moecomm router: {flag} names a front end twice: {text}")
    return urls


def check_front_end(url: str, role: str, model_name: str, headers: dict | None = None) -> None:
    """SystemExit unless `url` answers /pd/info (asked with `headers`: the deployment secret)
    with a role that can serve `role` and the same model name."""
    flag = f"--{role}"
    try:
        r = httpx.get(f"{url}/pd/info", timeout=INFO_TIMEOUT_S, headers=headers)
    except httpx.HTTPError as exc:
        raise SystemExit(
            f"moecomm router: {flag} {url} does not answer ({type(exc).__name__}: {exc})"
        ) from None
    if r.status_code in (401, 403):
        raise SystemExit(
            f"moecomm router: {flag} {url} refused the deployment secret ({r.status_code}): give "
            "the router and every front end the same --pd-secret-file or $MOECOMM_PD_SECRET"
        )
    if r.status_code == 404:
        raise SystemExit(
            f"moecomm router: {flag} {url} is not a prefill/decode front end (no /pd/info): "
            f"start it with `moecomm frontend --role {role}`"
        )
    try:
        r.raise_for_status()
        info = r.json()
        served_role, model = info["role"], info["model"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(
            f"moecomm router: {flag} {url}: /pd/info answered {r.status_code} without a role "
            f"({exc})"
        ) from None
    if served_role not in ACCEPTED_ROLES[role]:
        raise SystemExit(
            f"moecomm router: {flag} {url} is a front end of role {served_role!r}; {flag} takes "
            f"role {' or '.join(repr(x) for x in ACCEPTED_ROLES[role])}"
        )
    if model != model_name:
        raise SystemExit(
            f"moecomm router: {flag} {url} serves model {model!r}, the router {model_name!r} "
            "(give every process the same --model-name)"
        )


def run(args: argparse.Namespace) -> int:
    prefill = parse_urls(args.prefill, "--prefill")
    decode = parse_urls(args.decode, "--decode")
    if args.request_timeout <= 0 or args.backend_timeout <= 0:
        raise SystemExit("moecomm router: --request-timeout and --backend-timeout must be > 0")
    if args.prefix_affinity_tokens < 0:
        raise SystemExit("moecomm router: --prefix-affinity-tokens must be >= 0")
    if args.max_local_prefill_tokens < 0:
        raise SystemExit("moecomm router: --max-local-prefill-tokens must be >= 0")
    access = access_from_args(args, "router")
    secret = access.deployment
    headers = None if secret is None else secret.headers()
    config = MoEConfig.from_file(args.checkpoint)
    tokenizer = load_tokenizer(args.checkpoint, config)
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    for role, urls in ((PREFILL, prefill), (DECODE, decode)):
        for url in urls:
            check_front_end(url, role, name, headers)
    router = Router(
        tokenizer,
        name,
        config.vocab_size,
        config.max_position_embeddings,
        prefill,
        decode,
        request_timeout_s=args.request_timeout,
        backend_timeout_s=args.backend_timeout,
        affinity_tokens=args.prefix_affinity_tokens,
        max_local_prefill_tokens=args.max_local_prefill_tokens,
        secret=secret,
    )
    stop = stop_on_signals()
    app = make_router_app(router, api_key=access.api_key)
    http = HttpServer(app, args.host, args.port, what="the router")
    http.start()
    print(f"router {name} listening on {http.url}", flush=True)
    announce_ready("router", url=http.url, name=name)
    try:
        wait_for_stop(stop)
    finally:
        print("router: stopping", flush=True)
        http.stop()
    return 0
