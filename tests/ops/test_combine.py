"""Combine: bit-exact against the token-by-token reference, reproducible, close to an f64 sum,
and the whole client path (pack → simulated expert servers → combine) against a dense MoE."""

import pytest
import torch
from moecomm._C import Encoding
from moecomm.ops.combine import combine, combine_reference
from moecomm.ops.dispatch import ExpertMap, pack_dispatch
from moecomm.ops.quant import dequantize

H = 136  # not a multiple of 128
# f32 accumulation of a handful of O(1) terms vs an f64 sum: a few f32 ulps.
F32_SUM_TOL = 1e-6


def make_partials(t: int, num_servers: int, dtype: torch.dtype, seed: int = 0):
    """Each server answers for a random subset of the tokens, in increasing token order."""
    g = torch.Generator().manual_seed(seed)
    partials, index = [], []
    for _ in range(num_servers):
        rows = torch.nonzero(torch.rand(t, generator=g) < 0.6).squeeze(1)
        partials.append(torch.randn(rows.numel(), H, generator=g).to(dtype))
        index.append(rows)
    return partials, index


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("t", "servers"), [(0, 3), (1, 1), (1, 4), (25, 3), (64, 5)])
def test_combine_matches_reference_and_f64_sum(t, servers, dtype):
    partials, index = make_partials(t, servers, dtype, seed=t + servers)
    saved = [p.clone() for p in partials] + [i.clone() for i in index]
    y = combine(partials, index, t)
    assert y.shape == (t, H) and y.dtype == dtype
    assert torch.equal(y, combine_reference(partials, index, t))
    assert torch.equal(y, combine(partials, index, t)), "same inputs, same bits"
    exact = torch.zeros(t, H, dtype=torch.float64)
    for p, i in zip(partials, index, strict=True):
        exact[i] += p.double()
    y32 = combine(partials, index, t, dtype=torch.float32)
    assert torch.allclose(y32.double(), exact, rtol=F32_SUM_TOL, atol=F32_SUM_TOL)
    untouched = torch.ones(t, dtype=torch.bool)
    for i in index:
        untouched[i] = False
    assert not bool(y32[untouched].any()), "a token no server received combines to zero"
    for a, b in zip(partials + index, saved, strict=True):
        assert torch.equal(a, b)


def test_server_order_is_the_summation_order():
    # Three values whose f32 sum depends on the order: (1 + 2^-24) + 2^-24 rounds twice.
    a, b, c = (torch.full((1, H), v) for v in (1.0, 2.0**-24, 2.0**-24))
    idx = [torch.zeros(1, dtype=torch.int64)] * 3
    left = combine([a, b, c], idx, 1)
    right = combine([b, c, a], idx, 1)
    assert bool((left == 1.0).all()) and bool((right == 1.0 + 2.0**-23).all())
    assert torch.equal(left, combine_reference([a, b, c], idx, 1))
    assert torch.equal(right, combine_reference([b, c, a], idx, 1))


def test_output_dtype_rules_and_no_partials():
    p, i = make_partials(5, 2, torch.bfloat16)
    assert combine(p, i, 5).dtype == torch.bfloat16
    assert combine([p[0], p[1].float()], i, 5).dtype == torch.float32
    assert combine(p, i, 5, dtype=torch.float16).dtype == torch.float16
    y = combine([], [], 3, hidden=H)
    assert y.shape == (3, H) and y.dtype == torch.float32 and not bool(y.any())


def test_non_contiguous_partials():
    p, i = make_partials(30, 3, torch.float32, seed=3)
    p_nc = [x.t().contiguous().t() for x in p]
    assert not any(x.is_contiguous() for x in p_nc if x.shape[0] > 1)
    assert torch.equal(combine(p_nc, i, 30), combine_reference(p, i, 30))


@pytest.mark.parametrize("enc", [Encoding.F32, Encoding.INT8, Encoding.FP8_E4M3_B128])
def test_pack_serve_combine_equals_dense_moe(enc):
    """The client path end to end: servers compute Σ score · expert(x) over their local experts
    from the packed request; combine must give the dense top-k MoE output."""
    g = torch.Generator().manual_seed(21)
    t, k, num_experts = 33, 3, 6
    emap = ExpertMap([[(e % 3, e // 3), ((e + 1) % 3, 2 + e // 3)] for e in range(num_experts)])
    weights = torch.randn(num_experts, H, H, generator=g) / H**0.5
    x = torch.randn(t, H, generator=g)
    ids = torch.rand(t, num_experts, generator=g).topk(k, dim=1).indices
    w = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    local_to_logical = {p: e for e in range(num_experts) for p in emap.replicas(e)}

    batches = pack_dispatch(x, ids, w, emap, enc)
    partials = []
    for b in batches:
        xs = b.activations.float() if b.scales is None else dequantize(b.activations, b.scales, enc)
        out = torch.zeros(b.num_tokens, H)
        for row in range(b.num_tokens):
            for j in range(k):
                local = int(b.expert_ids[row, j])
                if local >= 0:
                    e = local_to_logical[b.server, local]
                    out[row] += b.scores[row, j] * (xs[row] @ weights[e])
        partials.append(out)
    y = combine(partials, [b.token_index for b in batches], t)

    dense = torch.zeros(t, H)
    for i in range(t):
        for j in range(k):
            dense[i] += w[i, j] * (x[i] @ weights[ids[i, j]])
    # Unquantized: only the summation order differs. Quantized: the activation error, at most
    # 1/254 (int8) or ~1/16 (fp8) of the token's range, propagated through a 1/sqrt(H) matrix.
    tol = {Encoding.F32: 1e-5, Encoding.INT8: 0.03, Encoding.FP8_E4M3_B128: 0.25}[enc]
    assert torch.allclose(y, dense, atol=tol, rtol=0), (y - dense).abs().max().item()


def test_combine_rejects_bad_arguments():
    p, i = make_partials(4, 2, torch.float32)
    with pytest.raises(ValueError, match="got 2 partials and 1 token_index"):
        combine(p, i[:1], 4)
    with pytest.raises(ValueError, match=r"token_index\[0\] must be int64 of shape"):
        combine(p, [i[0].int(), i[1]], 4)
    with pytest.raises(ValueError, match=r"token_index\[\d\] must be in \[0, 2\)"):
        combine(p, i, 2)
    with pytest.raises(ValueError, match=r"partials\[1\] must have shape \[n, 136\], got"):
        combine([p[0], p[1][:, :5]], i, 4)
    with pytest.raises(TypeError, match=r"partials\[0\] must be bfloat16, float16 or float32"):
        combine([p[0].double(), p[1]], i, 4)
    with pytest.raises(ValueError, match="hidden must be given"):
        combine([], [], 4)
    with pytest.raises(ValueError, match="num_tokens must be an int >= 0, got -1"):
        combine(p, i, -1)
    with pytest.raises(TypeError, match="dtype must be bfloat16, float16 or float32"):
        combine(p, i, 4, dtype=torch.int8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_into_caller_owned_memory_is_the_same_and_reuses_it(dtype):
    """out= and acc= give the plain combine's bits, sizes changing every call, the warm
    accumulator reused dirty (poisoned with NaN) between calls."""
    acc = torch.full((64, H), float("nan"))
    for step, t in enumerate([64, 3, 40, 1, 0, 64]):
        partials, index = make_partials(t, 3, dtype, seed=step)
        want = combine(partials, index, t, dtype=dtype)
        out = torch.full((t, H), float("nan"), dtype=dtype)
        got = combine(partials, index, t, dtype=dtype, out=out, acc=acc)
        assert got is out and torch.equal(got, want)
        acc.fill_(float("nan"))


def test_combine_refuses_wrong_caller_memory():
    partials, index = make_partials(4, 2, torch.float32)
    with pytest.raises(ValueError, match=r"out must be \[4, "):
        combine(partials, index, 4, out=torch.empty(3, H))
    with pytest.raises(TypeError, match=r"out: expected dtype torch\.float32"):
        combine(partials, index, 4, out=torch.empty(4, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"acc must hold \[4, "):
        combine(partials, index, 4, dtype=torch.bfloat16, acc=torch.empty(2, H))
