"""On the CPU, the reference and bound of test_device_roundtrip.py (roundtrip_reference.py): the
GPU path's arithmetic replayed here — two servers each summing its experts' rows into a bf16
response, the client summing the responses — is inside the bound whichever server holds which
expert, and in float64 too; a step that drops a router weight, or swaps the gate and up
projections, is not, and the failure names the step, the token's experts and the element."""

from __future__ import annotations

import pytest
import torch
from moecomm.runtime import random_experts
from roundtrip_reference import FP8_REL_TOL, assert_matches, bf16_reference, fp8_close

LAYERS, EXPERTS, HIDDEN, INTER, SEED, TOPK = 1, 8, 256, 128, 3, 4


def _case(n: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(n)]).int()
    w = torch.rand(n, TOPK, generator=g)
    experts = random_experts(LAYERS, EXPERTS, HIDDEN, INTER, seed=SEED, dtype=torch.bfloat16)[0]
    return x, ids, w, experts


def device_path(x, ids, w, experts, servers, wide=torch.float32, drop_weight=False, swap=False):
    """The GPU path's arithmetic in k order: per server the sum of its rows in ``wide``,
    rounded to the bf16 response; the client's sum of the responses, rounded to bf16."""
    n = x.shape[0]
    out = torch.zeros(n, HIDDEN, dtype=wide)
    for held in servers:
        partial = torch.zeros(n, HIDDEN, dtype=wide)
        for t in range(n):
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                if e not in held:
                    continue
                ew = experts[e]
                xt = x[t].to(wide)
                w1, w3 = (ew.w3, ew.w1) if swap else (ew.w1, ew.w3)
                g_ = w1.to(wide) @ xt
                u = w3.to(wide) @ xt
                h = (torch.nn.functional.silu(g_) * u).to(torch.bfloat16).to(wide)
                s = 1.0 if (drop_weight and k == 0) else float(w[t, k])
                row = (s * (ew.w2.to(wide) @ h)).to(torch.bfloat16)
                partial[t] += row.to(wide)
        out += partial.to(torch.bfloat16).to(wide)
    return out.to(torch.bfloat16).float()


SPLIT = [set(range(4)), set(range(4, 8))]
ONE = [set(range(8))]
ODD = [{0, 2, 5}, {1, 3, 4, 6, 7}]  # a replica choice that splits tokens differently


@pytest.mark.parametrize("servers", [SPLIT, ONE, ODD], ids=["0-3|4-7", "0-7", "odd"])
def test_the_device_paths_arithmetic_is_inside_the_bound(servers):
    x, ids, w, experts = _case()
    assert_matches(device_path(x, ids, w, experts, servers), x, ids, w, experts, "step 0")
    wide = device_path(x, ids, w, experts, servers, wide=torch.float64)
    assert_matches(wide, x, ids, w, experts, "step 0 (float64)")


def test_real_errors_are_caught_and_named():
    x, ids, w, experts = _case()
    dropped = device_path(x, ids, w, experts, SPLIT, drop_weight=True)
    with pytest.raises(AssertionError) as err:
        assert_matches(dropped, x, ids, w, experts, "step 7 (layer 1)")
    text = str(err.value)
    assert text.startswith("step 7 (layer 1): ") and "off by more than their bound" in text
    assert "experts [" in text and "element " in text and "x its bound" in text
    swapped = device_path(x, ids, w, experts, SPLIT, swap=True)
    with pytest.raises(AssertionError, match="off by more than their bound"):
        assert_matches(swapped, x, ids, w, experts, "step 1")
    nan = device_path(x, ids, w, experts, SPLIT)
    nan[3, 17] = float("nan")
    with pytest.raises(AssertionError, match=r"step 2: token 3 .* element 17: nan"):
        assert_matches(nan, x, ids, w, experts, "step 2")


def test_the_fp8_check_names_the_worst_token():
    x, ids, w, experts = _case(8)
    ref, bound = bf16_reference(x, ids, w, experts)
    assert (bound > 0).all()
    fp8_close(ref * (1 + FP8_REL_TOL / 2), x, ids, w, experts, "fp8 step 0")
    off = ref.clone()
    off[5] *= 3.0
    with pytest.raises(AssertionError, match=r"fp8 step 1 \(8 tokens\): .* worst token 5 "):
        fp8_close(off, x, ids, w, experts, "fp8 step 1 (8 tokens)")
