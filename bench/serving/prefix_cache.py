"""Prefix cache: TTFT of a shared-prefix workload with and without the cache (issue 31 item 2).

A tiny random checkpoint (``--arch``) served by the real continuous-batching engine, in this
process (local experts: the prefill compute is what the cache saves; expert servers would add
the same dispatch per skipped token). Every request is one long shared prefix (a system
prompt, ``--prefix`` tokens) plus a short distinct tail (``--tail`` tokens), answered with
``--new`` tokens; requests go one at a time, so TTFT is the request's own prefill and first
decode, not queueing. Three engines run the same requests:

- ``growable``: the old KV cache (one growable buffer per request and layer);
- ``paged``: the paged cache, no prefix cache (the paging overhead alone);
- ``paged+prefix``: the paged cache and a prefix cache of ``--cache-mib``.

Reported per engine: TTFT and ITL medians and p99 over the requests after the first (the
first fills the cache), ratios to ``paged`` (contender / reference: < 1 is faster), the
prefix cache's hit rate, the bytes it holds, and its own estimate of the TTFT saved (what
/metrics exports) next to the measured one. Outputs are checked equal across the engines.

Usage: python bench/serving/prefix_cache.py [--arch mixtral] [--requests 12] [--prefix 512]
       [--tail 16]
       [--new 8] [--json bench/results/prefix_cache.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts
import itertools

from _lib.common import format_table, percentile, write_json
from moecomm_serving.engine.scheduler import Engine, EngineRequest
from moecomm_serving.model.tiny import ARCHS, write_tiny
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import ErrorEvent, FinishEvent, SamplingParams, TokenEvent

# Tokens one engine step carries: the whole prompt in one prefill forward (no chunking, so
# TTFT is one forward plus the first decode).
MAX_BATCH_TOKENS = 2048
# A request that takes longer than this has hung: the bench fails instead of waiting.
REQUEST_TIMEOUT_S = 300.0
SEED = 0


def run_requests(engine: Engine, prompts, params) -> list[dict]:
    """Each prompt alone, in order; its tokens, TTFT and inter-token gaps."""
    out = []
    for prompt in prompts:
        done = threading.Event()
        times: list[float] = []
        tokens: list[int] = []
        errors: list[str] = []

        def emit(ev, times=times, tokens=tokens, errors=errors, done=done):
            if isinstance(ev, TokenEvent):
                times.append(ev.time)
                tokens.append(ev.token)
            elif isinstance(ev, ErrorEvent):
                errors.append(ev.message)
                done.set()
            elif isinstance(ev, FinishEvent):
                done.set()

        t0 = time.monotonic()
        engine.submit(EngineRequest(list(prompt), params, emit, t0 + REQUEST_TIMEOUT_S))
        if not done.wait(REQUEST_TIMEOUT_S):
            raise RuntimeError(f"a request did not finish in {REQUEST_TIMEOUT_S} s")
        if errors:
            raise RuntimeError(f"request failed: {errors}")
        gaps = [b - a for a, b in itertools.pairwise(times)]
        out.append({"tokens": tokens, "ttft_s": times[0] - t0, "gaps_s": gaps})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arch", default="mixtral", choices=ARCHS)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prefix", type=int, default=512, help="shared prompt tokens")
    ap.add_argument("--tail", type=int, default=16, help="distinct prompt tokens per request")
    ap.add_argument("--new", type=int, default=8, help="generated tokens per request")
    ap.add_argument("--block", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--cache-mib", type=float, default=64.0, help="prefix cache budget (MiB)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--json", default="bench/results/prefix_cache.json")
    a = ap.parse_args(argv)
    if a.requests < 2 or a.prefix < 1 or a.tail < 1 or a.new < 2:
        raise SystemExit("need --requests >= 2, --prefix >= 1, --tail >= 1, --new >= 2")
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as d:
        write_tiny(d, a.arch, seed=SEED)
        model = load_model(d, dtype=torch.float32)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(SEED)
    shared = torch.randint(0, vocab, (a.prefix,), generator=g).tolist()
    prompts = [
        shared + torch.randint(0, vocab, (a.tail,), generator=g).tolist() for _ in range(a.requests)
    ]
    params = SamplingParams(a.new, ignore_eos=True)
    budget = int(a.cache_mib * 2**20)
    engines = {
        "growable": {"kv_block_tokens": None},
        "paged": {"kv_block_tokens": a.block},
        "paged+prefix": {"kv_block_tokens": a.block, "prefix_cache_bytes": budget},
    }
    rows, runs, cache_info = [], {}, {}
    for name, kwargs in engines.items():
        engine = Engine(model, MAX_BATCH_TOKENS, **kwargs).start()
        try:
            runs[name] = run_requests(engine, prompts, params)
        finally:
            engine.stop()
        steady = runs[name][1:]  # the first request fills the prefix cache
        ttft = [r["ttft_s"] for r in steady]
        gaps = [x for r in steady for x in r["gaps_s"]]
        rows.append(
            {
                "engine": name,
                "ttft_p50_ms": percentile(ttft, 50) * 1e3,
                "ttft_p99_ms": percentile(ttft, 99) * 1e3,
                "itl_p50_ms": percentile(gaps, 50) * 1e3,
                "itl_p99_ms": percentile(gaps, 99) * 1e3,
            }
        )
        if engine.prefix_cache is not None:
            s = engine.prefix_cache.stats
            cache_info = {
                "hit_rate": s.hit_rate,
                "hits": s.hits,
                "lookups": s.lookups,
                "hit_tokens": s.hit_tokens,
                "cached_bytes": engine.prefix_cache.bytes,
                "budget_bytes": budget,
                "estimated_saved_prefill_s": s.saved_prefill_s,
            }
    equal = all(
        [r["tokens"] for r in runs[n]] == [r["tokens"] for r in runs["growable"]] for n in runs
    )
    ref = next(r for r in rows if r["engine"] == "paged")
    for r in rows:
        r["ttft_ratio"] = r["ttft_p50_ms"] / ref["ttft_p50_ms"]
        r["itl_ratio"] = r["itl_p50_ms"] / ref["itl_p50_ms"]
    measured_saved = sum(
        x["ttft_s"] - y["ttft_s"]
        for x, y in zip(runs["paged"][1:], runs["paged+prefix"][1:], strict=True)
    )
    cache_info["measured_saved_ttft_s"] = measured_saved
    print(
        f"{a.arch}: {a.requests} requests of {a.prefix} shared + {a.tail} own prompt tokens, "
        f"{a.new} generated, blocks of {a.block}; one request at a time; medians and p99 over "
        f"requests 2..{a.requests}; ratios: engine / paged"
    )
    cols = [
        ("engine", "engine", ""),
        ("ttft_p50_ms", "TTFT p50 ms", ".1f"),
        ("ttft_p99_ms", "TTFT p99 ms", ".1f"),
        ("ttft_ratio", "TTFT ratio", ".2f"),
        ("itl_p50_ms", "ITL p50 ms", ".1f"),
        ("itl_p99_ms", "ITL p99 ms", ".1f"),
        ("itl_ratio", "ITL ratio", ".2f"),
    ]
    print(format_table(rows, cols))
    print(
        f"prefix cache: hit rate {cache_info['hit_rate']:.2f} of prompt tokens "
        f"({cache_info['hits']}/{cache_info['lookups']} prompts hit), "
        f"{cache_info['cached_bytes'] / 2**20:.2f} MiB held; TTFT saved: estimated "
        f"{cache_info['estimated_saved_prefill_s']:.2f} s, measured {measured_saved:.2f} s"
    )
    print(f"outputs equal across engines: {equal}")
    write_json(
        a.json,
        {
            "arch": a.arch,
            "requests": a.requests,
            "prefix_tokens": a.prefix,
            "tail_tokens": a.tail,
            "new_tokens": a.new,
            "block_tokens": a.block,
            "torch_threads": torch.get_num_threads(),
            "rows": rows,
            "prefix_cache": cache_info,
            "outputs_equal": equal,
        },
    )
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
