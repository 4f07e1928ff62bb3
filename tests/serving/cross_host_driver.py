"""The front end of tests/serving/disagg/test_cross_host.py, run inside its own network namespace:
greedy generation with the experts on servers in other namespaces (found through the monitor,
reached over nixl), one step at a time, announcing each step on stdout so the test can kill a
server mid-generation. Halfway it waits for a server that joined after the start, so the rest of
the generation also runs through a newcomer. Writes what it generated and saw as JSON."""

from __future__ import annotations

import argparse
import json
import time

import httpx
import torch
from moecomm_serving.engine.generate import Generation, step
from moecomm_serving.model.remote_experts import RemoteExperts, connect_experts
from moecomm_serving.model.tokenizer import ByteTokenizer
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams

PROMPTS = ("experts on other hosts", "kill one and keep going")
JOIN_WAIT_S = 90.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--monitor", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    remote = RemoteExperts(monitor=args.monitor, transport="nixl", host=args.host, timeout=2.0)
    model_cfg = load_model(args.checkpoint, dtype=torch.float32).config
    client = connect_experts(
        remote, model_cfg.hidden_size, model_cfg.num_experts_per_tok, 64, out_dtype=torch.float32
    )
    first = set(client.pool.urls)
    try:
        model = load_model(args.checkpoint, experts=client, dtype=torch.float32)
        tok = ByteTokenizer()
        params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
        gens = [Generation(model, tok.encode(t), params) for t in PROMPTS]
        joined = None
        for i in range(args.tokens):
            if i == args.tokens // 2:  # the rest goes through a server that joined meanwhile
                print("waiting for a new server", flush=True)
                deadline = time.monotonic() + JOIN_WAIT_S
                while joined is None and time.monotonic() < deadline:
                    client.sync_membership()
                    fresh = [
                        u
                        for j, u in enumerate(client.pool.urls)
                        if u not in first and client.pool.live(j)
                    ]
                    joined = fresh[0] if fresh else None
                    time.sleep(0.2)
                if joined is None:
                    raise SystemExit("no new server joined")
            try:
                step(model, gens)
            except Exception:
                pool = client.pool
                print(
                    "urls",
                    pool.urls,
                    "evicted",
                    pool.evicted,
                    "missing",
                    pool.missing,
                    "hosted",
                    [{k: len(v) for k, v in h.items()} for h in pool.hosted],
                    flush=True,
                )
                raise
            print(f"step {i}", flush=True)
        served = {}
        for u in client.pool.urls:
            try:
                served[u] = httpx.get(f"{u}/health", timeout=5).json()
            except (httpx.HTTPError, ValueError) as exc:
                served[u] = {"error": str(exc)}
        out = {
            "tokens": [g.tokens for g in gens],
            "failovers": client.failovers,
            "joined": joined,
            "transports": {
                u: (ch.transport.name if ch is not None else None)
                for u, ch in zip(client.pool.urls, client.pool.channels, strict=True)
            },
            "health": served,
        }
        with open(args.out, "w") as f:
            json.dump(out, f)
    finally:
        client.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
