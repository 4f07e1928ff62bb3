"""AttentionClient against real expert-server processes over shm: requests packed straight into
the servers' slots, answers summed straight from the response slots into caller-owned memory.
Sizes change every step, both slots stay in flight, and the result is the same bits as the
allocating combine of the same answers."""

import pytest
import torch
from moecomm.runtime.experts import LayerExperts
from moecomm.runtime.launch import ModelSpec, spawn_expert_server
from moecomm.testing.clients import connect_client

SPEC = ModelSpec(num_layers=2, num_experts=6, hidden=64, intermediate=32, seed=4)
TOPK, MAX_TOKENS = 3, 24


@pytest.fixture(scope="module")
def servers():
    started = []
    try:
        started.append(spawn_expert_server(SPEC, {0: [0, 1, 2], 1: [0, 1, 2]}, "zc0"))
        started.append(spawn_expert_server(SPEC, {0: [3, 4, 5], 1: [3, 4, 5]}, "zc1"))
        yield started
    finally:
        for s in started:
            s.stop()


def routed(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, SPEC.hidden, generator=g)
    ids = torch.stack([torch.randperm(SPEC.num_experts, generator=g)[:TOPK] for _ in range(n)])
    return x, ids.to(torch.int32), torch.rand(n, TOPK, generator=g)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_in_place_dispatch_and_combine_into_caller_memory(servers, out_dtype):
    c = connect_client(servers, SPEC.hidden, TOPK, MAX_TOKENS, out_dtype=out_dtype)
    try:
        assert all(ch.zero_copy for ch in c.channels), "shm servers are mapped: packed in place"
        weights = SPEC.experts()
        pending = []
        for step in range(16):
            n = 1 + (step * 7) % MAX_TOKENS
            layer = step % 2
            x, ids, w = routed(n, step)
            pending.append((c.dispatch(x, ids, w, layer), x, ids, w, layer))
            if len(pending) == 2:  # both slots in flight, the older combined first
                h, x0, ids0, w0, layer0 = pending.pop(0)
                out = torch.full((h.num_tokens, SPEC.hidden), float("nan"), dtype=out_dtype)
                got = c.combine(h, out=out)
                assert got is out
                (mono,) = LayerExperts(layer0, weights[layer0]).forward([x0], [ids0], [w0])
                tol = 1e-5 if out_dtype == torch.float32 else 1e-2
                assert torch.allclose(got.float(), mono, rtol=tol, atol=tol), f"step {step}"
                # The same answers through the allocating combine: the same bits.
                again = c.combine(c.dispatch(x0, ids0, w0, layer0))
                assert torch.equal(again, got)
        for h, *_ in pending:
            c.combine(h)
    finally:
        c.close()
