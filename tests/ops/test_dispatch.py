"""Dispatch packing: bit-exact against the pure-Python reference, plus invariants checked from
the data itself (row t of x carries t, so every packed row says where it came from)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moecomm._C import Encoding
from moecomm.ops.dispatch import ExpertMap, pack_dispatch, pack_dispatch_reference
from moecomm.ops.quant import encoding_dtype, quantize_reference

H = 200  # not a multiple of the 128-channel scale block
ALL_ENCODINGS = list(Encoding.__members__.values())


def make_map() -> ExpertMap:
    """8 experts on 4 servers; experts 0 and 5 have two replicas; server 3 hosts only expert 7."""
    return ExpertMap(
        [
            [(0, 0), (1, 2)],
            [(0, 1)],
            [(1, 0)],
            [(1, 1)],
            [(2, 0)],
            [(2, 1), (0, 2)],
            [(2, 2)],
            [(3, 0)],
        ]
    )


def make_batch(t: int, k: int, num_experts: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    x[:, 0] = torch.arange(t, dtype=torch.float32)  # the row's origin, readable after packing
    scores = torch.rand(t, num_experts, generator=g)
    ids = scores.topk(k, dim=1).indices
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    return x, ids, weights


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_same(got, want):
    assert [b.server for b in got] == [b.server for b in want]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(bits(a.activations), bits(b.activations))
        assert (a.scales is None) == (b.scales is None)
        if a.scales is not None:
            assert torch.equal(a.scales, b.scales)
        assert torch.equal(a.expert_ids, b.expert_ids)
        assert torch.equal(a.scores, b.scores)
        assert torch.equal(a.token_index, b.token_index)


def assert_invariants(batches, x, ids, weights, emap: ExpertMap, enc: Encoding):
    """What any correct packing satisfies, checked without the reference."""
    k = ids.shape[1]
    covered = torch.zeros_like(ids, dtype=torch.int64)
    for b in batches:
        n = b.num_tokens
        assert n > 0
        assert b.activations.shape == (n, H) and b.activations.dtype == encoding_dtype(enc)
        assert b.expert_ids.shape == (n, k) and b.expert_ids.dtype == torch.int32
        assert b.scores.shape == (n, k) and b.scores.dtype == torch.float32
        assert b.token_index.dtype == torch.int64
        for tensor in (b.activations, b.expert_ids, b.scores, b.token_index):
            assert tensor.is_contiguous()
        assert bool((b.token_index[1:] > b.token_index[:-1]).all()), "rows keep batch order"
        if enc == Encoding.F32:
            assert torch.equal(b.activations[:, 0].long(), b.token_index)
        for row, t in enumerate(b.token_index.tolist()):
            assert bool((b.expert_ids[row] >= 0).any()), "every packed token has an expert here"
            for j in range(k):
                local = int(b.expert_ids[row, j])
                if local < 0:
                    assert b.scores[row, j] == 0
                    continue
                assert (b.server, local) in emap.replicas(int(ids[t, j]))
                assert b.scores[row, j] == weights[t, j].float()
                covered[t, j] += 1
    assert torch.equal(covered, (ids >= 0).long()), "each routed (token, k) goes to one server"


@pytest.mark.parametrize("enc", ALL_ENCODINGS)
@pytest.mark.parametrize(("t", "k"), [(0, 2), (1, 1), (1, 4), (13, 2), (40, 3)])
def test_pack_matches_reference_and_invariants(t, k, enc):
    emap = make_map()
    x, ids, weights = make_batch(t, k, seed=t * 10 + k)
    got = pack_dispatch(x, ids, weights, emap, enc)
    assert_same(got, pack_dispatch_reference(x, ids, weights, emap, enc))
    assert_invariants(got, x, ids, weights, emap, enc)
    if enc in (Encoding.INT8, Encoding.FP8_E4M3_B128):
        q, s = quantize_reference(x, enc)
        for b in got:  # early quantization: the packed rows are the quantized rows of x
            assert torch.equal(bits(b.activations), bits(q[b.token_index]))
            assert torch.equal(b.scales, s[b.token_index])
    if t == 0:
        assert got == []


def test_one_expert_holds_every_token_and_idle_servers_are_skipped():
    emap = make_map()
    x, _, _ = make_batch(9, 1)
    ids = torch.full((9, 1), 3)  # expert 3 lives only on server 1
    w = torch.ones(9, 1)
    got = pack_dispatch(x, ids, w, emap, Encoding.FP8_E4M3)
    assert [b.server for b in got] == [1]
    assert torch.equal(got[0].token_index, torch.arange(9))
    assert torch.equal(got[0].expert_ids, torch.ones(9, 1, dtype=torch.int32))
    assert_same(got, pack_dispatch_reference(x, ids, w, emap, Encoding.FP8_E4M3))


def test_unrouted_slots_and_tokens_are_dropped():
    emap = make_map()
    x, ids, w = make_batch(6, 2)
    ids[2] = -1  # a padding token: goes nowhere
    ids[4, 1] = -1
    got = pack_dispatch(x, ids, w, emap, Encoding.BF16)
    assert all(2 not in b.token_index.tolist() for b in got)
    assert_same(got, pack_dispatch_reference(x, ids, w, emap, Encoding.BF16))
    assert_invariants(got, x, ids, w, emap, Encoding.BF16)


def test_default_replica_rule_round_robins_over_tokens():
    emap = make_map()
    x, _, _ = make_batch(6, 1)
    ids = torch.zeros(6, 1, dtype=torch.int32)  # expert 0: replicas (0, 0) and (1, 2)
    got = pack_dispatch(x, ids, torch.ones(6, 1), emap)
    assert {b.server: b.token_index.tolist() for b in got} == {0: [0, 2, 4], 1: [1, 3, 5]}
    assert got[1].expert_ids.flatten().tolist() == [2, 2, 2]


@pytest.mark.parametrize("per_choice", [False, True])
def test_replica_passed_in(per_choice):
    emap = make_map()
    x, ids, w = make_batch(11, 2, seed=5)
    if per_choice:
        g = torch.Generator().manual_seed(7)
        replica = (torch.rand(ids.shape, generator=g) * emap.num_replicas[ids]).long()
    else:
        replica = torch.tensor([1, 0, 0, 0, 0, 1, 0, 0])  # second replica of experts 0 and 5
    got = pack_dispatch(x, ids, w, emap, Encoding.INT8, replica)
    assert_same(got, pack_dispatch_reference(x, ids, w, emap, Encoding.INT8, replica))
    assert_invariants(got, x, ids, w, emap, Encoding.INT8)
    if not per_choice:
        on_server0 = [b for b in got if b.server == 0]
        assert all(0 not in b.expert_ids.tolist() for b in on_server0)  # (0, 0) never chosen


def test_non_contiguous_inputs_and_inputs_untouched():
    emap = make_map()
    x, ids, w = make_batch(12, 2, seed=9)
    x_nc = x.t().contiguous().t()
    ids_nc, w_nc = ids.t().contiguous().t(), w.t().contiguous().t()
    assert not (x_nc.is_contiguous() or ids_nc.is_contiguous() or w_nc.is_contiguous())
    saved = [t.clone() for t in (x, ids, w)]
    for enc in (Encoding.FP8_E4M3, Encoding.FP8_E4M3_B128, Encoding.F32):
        got = pack_dispatch(x_nc, ids_nc, w_nc, emap, enc)
        assert_same(got, pack_dispatch_reference(x, ids, w, emap, enc))
        assert_invariants(got, x, ids, w, emap, enc)
    for a, b in zip((x, ids, w), saved, strict=True):
        assert torch.equal(a, b)
    bf = x.bfloat16()
    got = pack_dispatch(bf, ids, w, emap)  # default encoding: the dtype of x
    assert all(b.activations.dtype == torch.bfloat16 for b in got)
    assert torch.equal(bf, x.bfloat16())


def test_expert_map_validation_and_server_loss():
    with pytest.raises(ValueError, match="at least one logical expert"):
        ExpertMap([])
    with pytest.raises(ValueError, match="logical expert 1 has no replica"):
        ExpertMap([[(0, 0)], []])
    with pytest.raises(ValueError, match=r"experts 0 and 1 both claim replica \(0, 0\)"):
        ExpertMap([[(0, 0)], [(0, 0)]])
    with pytest.raises(ValueError, match=r"expected server in \[0, 2\)"):
        ExpertMap([[(2, 0)]], num_servers=2)
    emap = make_map()
    assert (emap.num_experts, emap.num_servers) == (8, 4)
    with pytest.raises(ValueError, match="logical expert 1 has no replica"):
        emap.without_server(0)  # expert 1 lives only on server 0
    emap = ExpertMap([[(0, 0), (1, 0)], [(0, 1), (2, 0)], [(1, 1)]])
    smaller = emap.without_server(0)
    assert smaller.num_servers == 3
    assert smaller.replicas(0) == ((1, 0),) and smaller.replicas(1) == ((2, 0),)
    x, _, w = make_batch(20, 2, seed=11)
    ids = torch.randint(0, 3, (20, 2), generator=torch.Generator().manual_seed(1))
    got = pack_dispatch(x, ids, w, smaller)
    assert got and all(b.server != 0 for b in got)
    assert_invariants(got, x, ids, w, smaller, Encoding.F32)


def test_pack_rejects_bad_arguments():
    emap = make_map()
    x, ids, w = make_batch(4, 2)
    with pytest.raises(TypeError, match=r"topk_ids must have dtype in .* got torch.float32"):
        pack_dispatch(x, ids.float(), w, emap)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[-1, 8\), got 8"):
        pack_dispatch(x, torch.full_like(ids, 8), w, emap)
    with pytest.raises(ValueError, match=r"topk_ids must have shape \[T=4, K>=1\], got \(3, 2\)"):
        pack_dispatch(x, ids[:3], w, emap)
    with pytest.raises(ValueError, match=r"topk_weights must have the shape of topk_ids"):
        pack_dispatch(x, ids, w[:, :1], emap)
    with pytest.raises(TypeError, match=r"topk_weights must have dtype in .* got torch.int64"):
        pack_dispatch(x, ids, ids, emap)
    with pytest.raises(TypeError, match=r"x must have dtype .* got torch.int64"):
        pack_dispatch(ids, ids, w, emap)
    with pytest.raises(ValueError, match=r"topk_ids must be on cpu like x, got meta"):
        pack_dispatch(x, ids.to("meta"), w, emap)
    with pytest.raises(TypeError, match=r"expert_map must be an ExpertMap, got dict"):
        pack_dispatch(x, ids, w, {})
    with pytest.raises(TypeError, match=r"encoding must be a moecomm._C.Encoding, got int"):
        pack_dispatch(x, ids, w, emap, 4)
    with pytest.raises(ValueError, match=r"replica must have shape \[E=8\] or \(4, 2\)"):
        pack_dispatch(x, ids, w, emap, replica=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"replica ordinals must be in \[0, num_replicas"):
        pack_dispatch(x, ids, w, emap, replica=torch.full((8,), 1))
    with pytest.raises(TypeError, match=r"replica must be an int32/int64 tensor, got torch.float"):
        pack_dispatch(x, ids, w, emap, replica=torch.zeros(8))


@st.composite
def routed_batches(draw):
    """A random expert map (1-4 servers, 1-6 experts, up to 3 replicas each) and a routed batch,
    with unrouted (-1) choices and an explicit replica choice half of the time."""
    num_servers = draw(st.integers(1, 4))
    num_experts = draw(st.integers(1, 6))
    slots = [(s, j) for s in range(num_servers) for j in range(6)]
    picks = draw(st.permutations(slots))
    replicas, used = [], 0
    for e in range(num_experts):
        spare = len(picks) - used - (num_experts - e - 1)  # leave one slot per later expert
        n = draw(st.integers(1, min(3, spare)))
        replicas.append(picks[used : used + n])
        used += n
    emap = ExpertMap(replicas, num_servers)
    t, k = draw(st.integers(0, 9)), draw(st.integers(1, 3))
    ids = torch.tensor(
        draw(
            st.lists(
                st.lists(st.integers(-1, num_experts - 1), min_size=k, max_size=k),
                min_size=t,
                max_size=t,
            )
        ),
        dtype=torch.int64,
    ).reshape(t, k)
    replica = None
    if draw(st.booleans()):
        replica = torch.tensor([draw(st.integers(0, len(r) - 1)) for r in replicas])
    seed = draw(st.integers(0, 2**16))
    return emap, ids, replica, seed


@settings(max_examples=40, deadline=None, derandomize=True, database=None)  # reproducible
@given(routed_batches(), st.sampled_from([Encoding.BF16, Encoding.INT8, Encoding.FP8_E4M3_B128]))
def test_pack_property(case, enc):
    emap, ids, replica, seed = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ids.shape[0], H, generator=g)
    x[:, 0] = torch.arange(ids.shape[0], dtype=torch.float32)
    w = torch.rand(ids.shape, generator=g)
    got = pack_dispatch(x, ids, w, emap, enc, replica)
    assert_same(got, pack_dispatch_reference(x, ids, w, emap, enc, replica))
    assert_invariants(got, x, ids, w, emap, enc)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(routed_batches(), st.booleans())
def test_native_router_equals_the_torch_router(case, per_choice):
    """The one-pass C++ router (the CPU default) and the torch ops it replaces agree bit for bit,
    also with a per-choice replica tensor."""
    import moecomm.ops.dispatch as dispatch

    emap, ids, replica, seed = case
    if per_choice and ids.numel():
        g = torch.Generator().manual_seed(seed)
        valid = ids.clamp(min=0)
        replica = (torch.rand(ids.shape, generator=g) * emap.num_replicas[valid]).long()
    assert dispatch._native_router() is not None, "the native router is not built"
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed))
    native = dispatch._route(ids, w, emap, replica)
    saved = dispatch._native_router
    dispatch._native_router = lambda: None
    try:
        reference = dispatch._route(ids, w, emap, replica)
    finally:
        dispatch._native_router = saved
    assert [r[0] for r in native] == [r[0] for r in reference]
    for a, b in zip(native, reference, strict=True):
        for u, v in zip(a[1:], b[1:], strict=True):
            assert u.dtype == v.dtype and torch.equal(u, v)
