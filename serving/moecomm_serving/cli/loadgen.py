"""``moecomm bench``: a load generator for any OpenAI-compatible endpoint.

Requests arrive as a Poisson process at ``--request-rate`` (all at once when infinite), at most
``--max-concurrency`` in flight; every request streams, so each token's arrival is timed on the
client. Prompts and output lengths come from a synthetic distribution (uniform within
``±range_ratio`` of ``--input-len`` / ``--output-len``) or a JSONL file. The report has the
familiar serving-benchmark shape (see docs/frontend.md for each field's definition) and is also
written as JSON.

Token counts come from the server's ``usage`` (``stream_options.include_usage``); a server that
sends none is counted by streamed chunks (output) and by characters / ``--chars-per-token``
(input), and the report says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import string
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

# Words of the synthetic prompts: lowercase ASCII, so any tokenizer encodes them losslessly.
WORD_CHARS = string.ascii_lowercase
# Synthetic text length per requested token: exact for the reference byte-level tokenizer.
DEFAULT_CHARS_PER_TOKEN = 1.0
# Percentiles the report lists besides mean and median.
PERCENTILES = (99,)
REPORT_WIDTH = 50
# How long the load generator waits for one complete answer before counting it failed: the
# benchmark's own patience with any endpoint (a moecomm front end ends a request itself after
# its scheduler's DEFAULT_REQUEST_TIMEOUT_S; this module imports no torch to read it).
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    counted_by_server: bool = False


def synthetic_requests(
    num: int, input_len: int, output_len: int, range_ratio: float, seed: int, chars_per_token
) -> list[BenchRequest]:
    """`num` prompts of random words; lengths uniform in ``[len*(1-r), len*(1+r)]``."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def length(center: int) -> int:
        lo, hi = math.ceil(center * (1 - range_ratio)), int(center * (1 + range_ratio))
        return max(1, rng.randint(lo, max(lo, hi)))

    out = []
    for _ in range(num):
        chars = max(1, round(length(input_len) * chars_per_token))
        words = []
        while sum(len(w) + 1 for w in words) < chars:
            words.append("".join(rng.choices(WORD_CHARS, k=rng.randint(2, 8))))
        out.append(BenchRequest(" ".join(words)[:chars], length(output_len)))
    return out


def jsonl_requests(path: str, num: int | None, default_output_len: int) -> list[BenchRequest]:
    """One JSON object per line: ``prompt`` (text), optional ``max_tokens`` / ``output_len``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                msg = f"{path}:{lineno}: need a JSON object with 'prompt': {exc}"
                raise ValueError(msg) from None
            n = row.get("max_tokens", row.get("output_len", default_output_len))
            out.append(BenchRequest(str(prompt), int(n)))
            if num is not None and len(out) == num:
                break
    if not out:
        raise ValueError(f"{path} holds no requests")
    return out


def _delta_of(chunk: dict, chat: bool) -> bool:
    """True when an SSE chunk carries a choice (a token, or the finishing chunk)."""
    choices = chunk.get("choices") or []
    return bool(choices) and ("delta" in choices[0] if chat else "text" in choices[0])


async def _one(client, url, model, req, chat, sampling, timeout) -> RequestResult:
    res = RequestResult()
    body = {"model": model, "max_tokens": req.max_tokens, "stream": True, **sampling}
    body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return res
                now = time.perf_counter()
                if _delta_of(chunk, chat):
                    if last is None:
                        res.ttft_s = now - start
                    else:
                        res.itls_s.append(now - last)
                    last = now
                    chunks += 1
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.counted_by_server = True
            if not done:
                res.error = "stream ended without [DONE]"
                return res
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e_s = time.perf_counter() - start
    if not res.counted_by_server:
        res.output_tokens = chunks
    res.ok = chunks > 0
    if not res.ok:
        res.error = "no token streamed"
    return res


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    v = sorted(x * scale for x in values)
    out = {"mean": statistics.fmean(v), "median": statistics.median(v)}
    for p in PERCENTILES:
        # nearest-rank percentile on the sorted samples
        out[f"p{p}"] = v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))]
    return out


def summarize(results: list[RequestResult], duration_s: float, prompts, chars_per_token) -> dict:
    ok = [r for r in results if r.ok]
    for r, req in zip(results, prompts, strict=True):
        if r.ok and not r.counted_by_server:
            r.prompt_tokens = round(len(req.prompt) / chars_per_token)
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": n_out / duration_s if duration_s else 0.0,
        "total_token_throughput": (n_in + n_out) / duration_s if duration_s else 0.0,
        "ttft_ms": _stats([r.ttft_s for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([x for r in ok for x in r.itls_s]),
        "e2el_ms": _stats([r.e2e_s for r in ok]),
        "tokens_counted_by_server": all(r.counted_by_server for r in ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }


def format_report(s: dict) -> str:
    w = REPORT_WIDTH

    def title(t: str) -> str:
        return f"{t:-^{w}}"

    def row(label: str, value) -> str:
        v = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<{w - 10}}{v:>10}"

    lines = [f"{' Serving Benchmark Result ':=^{w}}"]
    lines += [
        row("Successful requests:", s["successful_requests"]),
        row("Failed requests:", s["failed_requests"]),
        row("Benchmark duration (s):", s["duration_s"]),
        row("Total input tokens:", s["total_input_tokens"]),
        row("Total generated tokens:", s["total_output_tokens"]),
        row("Request throughput (req/s):", s["request_throughput"]),
        row("Output token throughput (tok/s):", s["output_throughput"]),
        row("Total token throughput (tok/s):", s["total_token_throughput"]),
    ]
    sections = [
        ("ttft_ms", "TTFT", "Time to First Token"),
        ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "ITL", "Inter-token Latency"),
        ("e2el_ms", "E2EL", "End-to-end Latency"),
    ]
    for key, short, name in sections:
        lines.append(title(name))
        lines.append(row(f"Mean {short} (ms):", s[key]["mean"]))
        lines.append(row(f"Median {short} (ms):", s[key]["median"]))
        for p in PERCENTILES:
            lines.append(row(f"P{p} {short} (ms):", s[key][f"p{p}"]))
    lines.append("=" * w)
    if s["errors"]:
        lines.append("Errors: " + "; ".join(s["errors"]))
    if not s["tokens_counted_by_server"]:
        lines.append("Note: the server sent no usage; token counts are client-side estimates.")
    return "\n".join(lines)


async def _resolve_model(client: httpx.AsyncClient, base_url: str, timeout: float) -> str:
    r = await client.get(f"{base_url}/v1/models", timeout=timeout)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_bench_async(
    base_url: str,
    requests: list[BenchRequest],
    model: str | None = None,
    endpoint: str = "/v1/completions",
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    seed: int = 0,
    timeout_s: float = REQUEST_TIMEOUT_S,
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
) -> dict:
    base_url = base_url.rstrip("/")
    chat = endpoint.rstrip("/").endswith("chat/completions")
    rng = random.Random(seed)
    sampling = {"temperature": temperature, "ignore_eos": ignore_eos}
    limit = max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    pool = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(limits=pool) as client:
        model = model or await _resolve_model(client, base_url, timeout_s)

        async def fire(req: BenchRequest) -> RequestResult:
            async with sem:
                one = _one(client, base_url + endpoint, model, req, chat, sampling, timeout_s)
                try:  # httpx's timeout bounds each read; this bounds the whole request
                    return await asyncio.wait_for(one, timeout_s)
                except asyncio.TimeoutError:
                    return RequestResult(error=f"no complete answer within {timeout_s} s")

        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            if i and math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
            tasks.append(asyncio.create_task(fire(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(list(results), duration, requests, chars_per_token)
    summary["config"] = {
        "base_url": base_url,
        "endpoint": endpoint,
        "model": model,
        "num_prompts": len(requests),
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "max_concurrency": max_concurrency,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
    }
    summary["requests"] = [asdict(r) for r in results]
    return summary


def run_bench(base_url: str, requests: list[BenchRequest] | None = None, **kwargs) -> dict:
    """Runs a benchmark and returns the report dict (what :func:`format_report` prints).

    Without `requests`, builds synthetic ones from ``num_prompts``, ``input_len``,
    ``output_len``, ``range_ratio`` (popped from `kwargs`); the rest go to
    :func:`run_bench_async`.
    """
    if requests is None:
        requests = synthetic_requests(
            kwargs.pop("num_prompts", 100),
            kwargs.pop("input_len", 128),
            kwargs.pop("output_len", 64),
            kwargs.pop("range_ratio", 0.0),
            kwargs.get("seed", 0),
            kwargs.get("chars_per_token", DEFAULT_CHARS_PER_TOKEN),
        )
    return asyncio.run(run_bench_async(base_url, requests, **kwargs))


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``moecomm bench`` arguments (pass a sub-parser to mount them under a CLI)."""
    p = parser or argparse.ArgumentParser(prog="moecomm bench", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s (default inf)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=128, help="synthetic prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths within ±ratio")
    p.add_argument("--dataset", default=None, help="JSONL file of {prompt, max_tokens}")
    p.add_argument("--chars-per-token", type=float, default=DEFAULT_CHARS_PER_TOKEN)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let EOS end a request early")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=REQUEST_TIMEOUT_S, help="per request, seconds")
    p.add_argument("--result-file", default=None, help="write the report as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    """Runs the benchmark the parsed arguments describe; prints the report; 1 if any failed."""
    if args.dataset:
        reqs = jsonl_requests(args.dataset, args.num_prompts, args.output_len)
    else:
        reqs = synthetic_requests(
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.seed,
            args.chars_per_token,
        )
    report = run_bench(
        args.base_url,
        reqs,
        model=args.model,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos,
        seed=args.seed,
        timeout_s=args.timeout,
        chars_per_token=args.chars_per_token,
    )
    print(format_report(report))
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 1 if report["failed_requests"] else 0


if __name__ == "__main__":
    sys.exit(main())
