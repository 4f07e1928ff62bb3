"""The CUDA path of moecomm.compat.deep_ep, the parts that run without a device: the pure-torch
conversions of compat/low_latency/device_ops.py (fed by a host simulation of what the device
kernels produce: the expanded dispatch, the client's routing, the server gather's
reorganization — moecomm.ops.reorganize, which the reorg kernels match bit for bit — and the
respond), checked against an independent reference of DeepEP's semantics, and the selection /
error behaviour of the Buffer. The GPU round trips are in test_deep_ep_cuda.py."""

from __future__ import annotations

import dataclasses
from unittest import mock

import moecomm.wire.cuda
import pytest
import torch
import torch.distributed as dist
from moecomm._C import Encoding
from moecomm.compat.deep_ep import Buffer
from moecomm.compat.low_latency.cast import deepep_cast, logfmt_roundtrip, pack_ue8m0
from moecomm.compat.low_latency.device_ops import (
    check_device_inputs,
    check_mode,
    combine_from_answers,
    expand_dispatch,
    expand_quantized,
    expert_rows,
    input_device,
    scatter_receive,
    ue8m0_scales,
)
from moecomm.compat.low_latency.layout import (
    LLShape,
    check_dispatch_inputs,
    check_peer_agrees,
    weighted_sum,
)
from moecomm.ops.reorg import reorganize

FP8 = Encoding.FP8_E4M3_B128
R, M, H, K, L = 3, 6, 512, 3, 2  # H: use_ue8m0 packs 4 scales of 128 per int32
E = R * L
NUM_SLOTS, SLOT = 2, 1
MAX_TOKENS = M * K + R  # expanded rows of one dispatch, sinks included


def _inputs(seed: int, rank: int, num_tokens: int):
    g = torch.Generator().manual_seed(seed * 31 + rank)
    x = (torch.randn(num_tokens, H, generator=g) * (1 + rank)).to(torch.bfloat16)
    perms = [torch.randperm(E, generator=g)[:K] for _ in range(num_tokens)]
    idx = torch.stack(perms) if perms else torch.empty(0, K)
    idx = idx.reshape(num_tokens, K).to(torch.int64)
    if num_tokens:
        idx[0, 1] = -1
    if num_tokens > 1 and rank == 2:
        idx[-1, :] = -1  # a token routed nowhere
    w = torch.rand(num_tokens, K, generator=g)
    return x, idx, w


def _expert_output(rows_f32: torch.Tensor, expert: int) -> torch.Tensor:
    return (rows_f32 * (1.0 + expert / 8.0)).to(torch.bfloat16)


class _Sim:
    """What the device kernels would produce for one dispatch of every rank (host torch)."""

    def __init__(self, inputs, use_fp8: bool):
        self.inputs, self.use_fp8 = inputs, use_fp8
        sink = torch.arange(E, E + R)
        w_exp = (torch.arange(MAX_TOKENS) // K).float().view(-1, 1)
        self.pos = []  # per client: [MAX_TOKENS, R] int32 (client workspace "pos")
        self.requests = []  # [client][server] = (acts, scales, ids, scores)
        for x, idx, _ in inputs:
            x_exp = torch.full((MAX_TOKENS, H), float("nan"), dtype=torch.bfloat16)
            ids_exp = torch.full((MAX_TOKENS, 1), 12345, dtype=torch.int64)
            n = expand_dispatch(x, idx, x_exp, ids_exp, sink)
            assert n == x.shape[0] * K + R
            ids = ids_exp[:n, 0]
            server = torch.where((ids >= 0) & (ids < E), ids // L, -1)
            server = torch.where(ids >= E, ids - E, server)
            local = torch.where(ids >= E, L, ids % L).to(torch.int32)
            pos = torch.full((MAX_TOKENS, R), -1, dtype=torch.int32)
            reqs = []
            for q in range(R):
                rows = torch.nonzero(server == q).squeeze(1)
                pos[rows, q] = torch.arange(rows.numel(), dtype=torch.int32)
                acts, scales = x_exp[rows], None
                if use_fp8:  # the CUDA path ships DeepEP's cast (expand_quantized)
                    acts, scales = deepep_cast(acts)
                reqs.append((acts, scales, local[rows].view(-1, 1), w_exp[rows]))
            self.pos.append(pos)
            self.requests.append(reqs)

    def gather(self, r: int):
        """Server r's gather workspace after admitting every rank's request of SLOT, with
        garbage past the filled rows (as the capacity-sized kernels leave it)."""
        g = torch.Generator().manual_seed(100 + r)
        batches = []
        for c in range(R):
            for s in range(NUM_SLOTS):
                if s == SLOT:
                    batches.append(self.requests[c][r])
                else:  # the other slot's entry: not admitted by this gather
                    batches.append(
                        (None, None, torch.empty(0, 1, dtype=torch.int32), torch.empty(0, 1))
                    )
        lay = reorganize([b[2] for b in batches], [b[3] for b in batches], L + 1)
        n = int(lay.offsets[-1])
        acts = torch.cat([b[0] for b in batches if b[0] is not None])
        step = R * MAX_TOKENS
        max_rows = step  # topk 1
        wire = acts.view(torch.uint8) if self.use_fp8 else acts
        rows = torch.randint(0, 255, (max_rows, wire.shape[1]), generator=g, dtype=torch.uint8)
        rows = rows if self.use_fp8 else torch.randn(max_rows, H, generator=g).to(wire.dtype)
        rows[:n] = wire.index_select(0, lay.src_token)
        scales = None
        if self.use_fp8:
            spt = H // 128
            scales = torch.rand(step, spt, generator=g) * 1e6
            cat = torch.cat([b[1] for b in batches if b[1] is not None])
            scales[: cat.shape[0]] = cat

        def cap(t, dtype, hi):
            out = torch.randint(-5, hi, (max_rows,), generator=g).to(dtype)
            out[:n] = t.to(dtype)
            return out

        self.layouts = getattr(self, "layouts", {})
        self.layouts[r] = lay
        return (
            lay.counts,
            lay.offsets,
            cap(lay.src_batch, torch.int32, 2 * R),
            cap(lay.src_token, torch.int64, 10**6),
            cap(lay.scores, torch.float32, 10**4),
            rows,
            scales,
        )

    def respond(self, r: int, expert_out: torch.Tensor) -> list[torch.Tensor]:
        """Server r's answer rows to each client (topk 1: the row's single copy, in bf16)."""
        lay = self.layouts[r]
        slot_of = lay.slot_of[:, 0]
        rows = expert_out.index_select(0, slot_of.clamp(min=0))
        rows[slot_of < 0] = 0
        bo = lay.batch_offsets.tolist()
        return [rows[bo[c * NUM_SLOTS + SLOT] : bo[c * NUM_SLOTS + SLOT + 1]] for c in range(R)]


def _source(x: torch.Tensor, use_fp8: bool, round_scale: bool = False):
    """(wire rows, scales, f32 values the receiver sees) of a source rank's tokens."""
    if not use_fp8:
        return x, None, x.float()
    q, s = deepep_cast(x, round_scale)
    return q, s, (q.float().view(-1, H // 128, 128) * s.unsqueeze(2)).view(-1, H)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_device_layout_conversions_match_deepep_semantics_bit_for_bit(use_fp8):
    inputs = [_inputs(7, p, n) for p, n in enumerate([M, 0, 4])]
    sim = _Sim(inputs, use_fp8)
    sources = [_source(x, use_fp8) for x, _, _ in inputs]
    answers = [[None] * R for _ in range(R)]  # [client][server]
    for r in range(R):
        counts, offsets, src_batch, src_token, row_scores, rows, scales = sim.gather(r)
        dtype = torch.uint8 if use_fp8 else torch.bfloat16
        data_store = torch.full((L + 1, R * M, H), 7, dtype=dtype)
        scale_store = torch.full((L + 1, H // 128, R * M), -3.0) if use_fp8 else None
        got = scatter_receive(
            counts, offsets, src_batch, src_token, row_scores, rows, scales,
            data_store, scale_store, R, NUM_SLOTS,
        )  # fmt: skip
        y = torch.full((L, R * M, H), float("nan"), dtype=torch.bfloat16)
        for e in range(L):
            ge = r * L + e
            want = [(p, t) for p in range(R) for t in range(inputs[p][0].shape[0])]
            want = [(p, t) for p, t in want if ge in inputs[p][1][t].tolist()]
            n = len(want)
            assert int(got.recv_count[e]) == n
            assert got.src_info[e, :n].tolist() == [t for _, t in want]
            assert bool((got.src_info[e, n:] == -1).all())
            begin = 0
            for p in range(R):
                c = sum(1 for q, _ in want if q == p)
                assert int(got.layout_range[e, p]) == (begin << 32) | c
                begin += c
            if not n:
                continue
            wire = torch.stack([sources[p][0][t] for p, t in want])
            if use_fp8:
                recv_scales = scale_store[:L].transpose(1, 2)
                assert recv_scales.stride(1) == 1
                assert torch.equal(data_store[e, :n], wire.view(torch.uint8))
                assert torch.equal(
                    recv_scales[e, :n], torch.stack([sources[p][1][t] for p, t in want])
                )
            else:
                assert torch.equal(data_store[e, :n].view(torch.int16), wire.view(torch.int16))
            y[e, :n] = _expert_output(torch.stack([sources[p][2][t] for p, t in want]), ge)
        expert_out = torch.full((rows.shape[0], H), float("nan"), dtype=torch.bfloat16)
        expert_rows(y, got.expert, got.pos, got.valid, expert_out)
        assert not bool(expert_out.isnan().any()), "a row past the counts was read"
        for c, ans in enumerate(sim.respond(r, expert_out)):
            answers[c][r] = ans
    for r in range(R):
        x, idx, w = inputs[r]
        # The response rings: one per server, rows at a stride, garbage around them.
        ring = torch.randn(R, MAX_TOKENS + 5, H).to(torch.bfloat16)
        for q in range(R):
            ring[q, 2 : 2 + answers[r][q].shape[0]] = answers[r][q]
        out = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
        combine_from_answers(ring[:, 2 : 2 + MAX_TOKENS], sim.pos[r], idx, w, L, out)
        deq = sources[r][2]
        ref = torch.zeros(x.shape[0], H)
        for t in range(x.shape[0]):
            for k in range(K):
                if int(idx[t, k]) >= 0:
                    ref[t] = ref[t] + w[t, k] * _expert_output(deq[t], int(idx[t, k])).float()
        assert torch.equal(out, ref.to(torch.bfloat16)), f"rank {r}: combine differs"


def test_combine_from_answers_is_the_host_reduction():
    # The host path's reduction (weighted_sum) and the device one agree bit for bit, in the
    # cases that expose the order: cancellation, a skipped k over a NaN row, ids out of range.
    g = torch.Generator().manual_seed(3)
    t, k, nr, nl, h = 5, 4, 2, 3, 8
    idx = torch.stack([torch.randperm(nr * nl, generator=g)[:k] for _ in range(t)])
    idx[0] = torch.tensor([0, 3, 1, 4])  # both ranks, interleaved
    idx[1, 2] = -1
    w = torch.rand(t, k, generator=g) * 1e4
    w[0] = torch.tensor([1.0, 1e8, -1e8, 3.0])
    answers = torch.randn(nr, t * k, h, generator=g).to(torch.bfloat16)
    pos = torch.full((t * k + nr, nr), -1, dtype=torch.int32)
    rows = torch.empty(t, k, dtype=torch.int64)
    used = [0] * nr
    for i in range(t * k):
        e = int(idx.view(-1)[i])
        if e >= 0:
            q = e // nl
            pos[i, q] = used[q]
            rows.view(-1)[i] = q * t * k + used[q]
            used[q] += 1
        else:
            answers[0, t * k - 1] = float("nan")  # never read: the skipped copy
            rows.view(-1)[i] = t * k - 1
    # Token 0 reads rows of ones: 1 + 1e8 - 1e8 + 3 is 3 in this order, 1 in the reverse one.
    answers.view(-1, h)[rows[0]] = 1.0
    out = torch.empty(t, h, dtype=torch.bfloat16)
    combine_from_answers(answers, pos, idx, w, nl, out)
    assert bool((out[0] == 3.0).all())
    host = weighted_sum(answers.view(-1, h), rows, idx, w).to(torch.bfloat16)
    assert torch.equal(out, host)


def test_expand_dispatch_writes_copies_then_sinks():
    x = torch.arange(6, dtype=torch.float32).view(2, 3).to(torch.bfloat16)
    idx = torch.tensor([[4, -1], [0, 2]])
    x_exp = torch.full((9, 3), float("nan"), dtype=torch.bfloat16)
    ids_exp = torch.full((9, 1), 99)
    n = expand_dispatch(x, idx, x_exp, ids_exp, torch.tensor([6, 7, 8]))
    assert n == 7
    assert ids_exp[:n, 0].tolist() == [4, -1, 0, 2, 6, 7, 8]
    assert torch.equal(x_exp[:4], x.repeat_interleave(2, 0))
    assert bool((x_exp[4:7] == 0).all()) and bool(x_exp[7:].isnan().all())
    # No tokens: only the sinks.
    n = expand_dispatch(x[:0], idx[:0], x_exp, ids_exp, torch.tensor([6, 7, 8]))
    assert n == 3 and ids_exp[:3, 0].tolist() == [6, 7, 8]


def test_expand_quantized_is_deepeps_cast_per_copy_and_ue8m0_its_packed_exponents():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 512, generator=g) * 10).to(torch.bfloat16)
    x[0, :128] = 0.0  # all-zero block
    x[1, 128:256] = (torch.randn(128, generator=g) * 1e-6).to(torch.bfloat16)  # below 1e-4
    x[2, 256:384] = 6e4  # huge
    for round_scale in (False, True):
        q_exp = torch.full((3 * 2 + 2, 512), 7, dtype=torch.uint8)
        s_exp = torch.full((3 * 2 + 2, 4), float("nan"))
        expand_quantized(x, 2, round_scale, q_exp, s_exp, 2)
        q, sc = deepep_cast(x, round_scale)
        assert torch.equal(q_exp[:6], q.view(torch.uint8).repeat_interleave(2, 0))
        assert torch.equal(s_exp[:6], sc.repeat_interleave(2, 0))
        assert bool((q_exp[6:] == 0).all()) and bool((s_exp[6:] == 0).all())
    # [L=2, H/128=4, rows=3] f32 power-of-two scales -> [2, 1, 3] int32, column-major like DeepEP.
    store = torch.stack([sc.t(), (sc * 2).t()])
    out = torch.zeros(2, 1, 3, dtype=torch.int32)
    ue8m0_scales(store, out)
    for e in range(2):
        assert torch.equal(out[e].t(), pack_ue8m0(store[e].t().contiguous()))
    assert int(out[0, 0, 0]) & 0xFF == (int(sc[0, 0].view(torch.int32)) >> 23) & 0xFF


def test_combine_from_answers_with_logfmt_decodes_every_answer_row():
    g = torch.Generator().manual_seed(6)
    t, k, nr, nl, h = 3, 2, 2, 2, 256
    idx = torch.tensor([[0, 3], [2, -1], [1, 2]])
    w = torch.rand(t, k, generator=g)
    answers = (torch.randn(nr, t * k, h, generator=g) * 0.01).to(torch.bfloat16)
    pos = torch.full((t * k + nr, nr), -1, dtype=torch.int32)
    used, ref = [0] * nr, torch.zeros(t, h)
    for i in range(t * k):
        e = int(idx.view(-1)[i])
        if e >= 0:
            q = e // nl
            pos[i, q] = used[q]
            row = answers[q, used[q]].view(1, h)
            ref[i // k] += w.view(-1)[i] * logfmt_roundtrip(row)[0]
            used[q] += 1
    out = torch.empty(t, h, dtype=torch.bfloat16)
    combine_from_answers(answers, pos, idx, w, nl, out, use_logfmt=True)
    assert torch.equal(out, ref.to(torch.bfloat16))
    plain = combine_from_answers(answers, pos, idx, w, nl, out.clone())
    assert not torch.equal(plain, out)  # LogFMT-10 is lossy on these rows


# ---------------------------------------------------------------------------- selection
def _fake_cuda(shape, dtype):
    t = mock.Mock(spec=torch.Tensor)
    t.is_cuda, t.device, t.dtype, t.shape = True, torch.device("cuda", 0), dtype, shape
    return t


def test_input_device_and_mode_reject_mixing():
    cpu = torch.zeros(2, 2)
    assert input_device(x=cpu, y=None) is None
    gpu = _fake_cuda((2, 2), torch.bfloat16)
    assert input_device(x=gpu, y=None) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="x on cuda:0 but topk_idx on the host"):
        input_device(x=gpu, topk_idx=cpu)
    other = _fake_cuda((2, 2), torch.bfloat16)
    other.device = torch.device("cuda", 1)
    with pytest.raises(ValueError, match="several CUDA devices"):
        input_device(x=gpu, topk_idx=other)
    assert check_mode(None, True) == "cuda" and check_mode("cpu", False) == "cpu"
    with pytest.raises(RuntimeError, match=r"runs on CPU tensors .* got CUDA tensors"):
        check_mode("cpu", True)
    with pytest.raises(RuntimeError, match=r"runs on CUDA tensors .* got CPU tensors"):
        check_mode("cuda", False)


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ((0, 4, False), "num_max_dispatch_tokens_per_rank must be a positive int, got 0"),
        ((4, True, False), "num_experts must be a positive int, got True"),
        ((3, 4, False), "x has 4 tokens, more than num_max_dispatch_tokens_per_rank=3"),
        ((4, 4, True), r"use_fp8 needs hidden to be a multiple of 128 .* got hidden=96"),
    ],
)
def test_host_and_device_dispatch_checks_name_bad_sizes_alike(sizes, match):
    x, idx = torch.zeros(4, 96, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64)
    for check in (check_dispatch_inputs, check_device_inputs):
        with pytest.raises(ValueError, match=match):
            check(x, idx, *sizes)


def test_a_peer_set_up_otherwise_is_named_with_both_shapes():
    mine = LLShape(8, 128, 4, 2)
    check_peer_agrees("deep_ep.Buffer", 0, 1, mine, LLShape(8, 128, 4, 2), True)
    theirs = dataclasses.replace(mine, hidden=256)
    with pytest.raises(
        ValueError,
        match=r"^deep_ep\.Buffer rank 0: rank 1 set up with .*hidden=256.*, this rank with "
        r".*hidden=128",
    ):
        check_peer_agrees("deep_ep.Buffer", 0, 1, mine, theirs, True)
    with pytest.raises(ValueError, match=r"^nixl_ep\.Buffer: rank 2 and rank 0 were given diff"):
        check_peer_agrees("nixl_ep.Buffer", 0, 2, mine, mine, False)


def _buffer(tmp_path):
    return Buffer(
        None,
        low_latency_mode=True,
        rank=0,
        num_ranks=1,
        store=dist.FileStore(str(tmp_path / "s"), 1),
        timeout=5,
    )


@pytest.mark.skipif(moecomm.wire.cuda.available(), reason="checks the error without a device")
def test_cuda_tensors_without_a_device_name_why(tmp_path):
    x, idx = _fake_cuda((4, 128), torch.bfloat16), _fake_cuda((4, 2), torch.int64)
    with _buffer(tmp_path) as buf:
        with pytest.raises(
            moecomm.wire.cuda.GpuUnavailableError, match="CUDA path cannot run"
        ) as ei:
            buf.low_latency_dispatch(x, idx, 4, 4)
        why = str(ei.value)
        assert ("no device" in why) or ("not built" in why), why
        assert not isinstance(ei.value, NotImplementedError)
    # Not built at all: said so.
    (tmp_path / "b").mkdir()
    unbuilt = mock.patch.object(moecomm.wire.cuda, "_import_native", lambda name: None)
    raises = pytest.raises(moecomm.wire.cuda.GpuUnavailableError, match="was not built")
    with _buffer(tmp_path / "b") as buf, unbuilt, raises:
        buf.low_latency_dispatch(x, idx, 4, 4)


def test_a_cpu_buffer_refuses_cuda_tensors_and_the_reverse(tmp_path):
    with _buffer(tmp_path) as buf:
        x = torch.randn(2, 128).to(torch.bfloat16)
        idx = torch.tensor([[0, 1], [1, -1]])
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 2, 2, use_fp8=False)
        with pytest.raises(RuntimeError, match="runs on CPU tensors"):
            buf.low_latency_dispatch(
                _fake_cuda((2, 128), torch.bfloat16), _fake_cuda((2, 2), torch.int64), 2, 2
            )
        with pytest.raises(ValueError, match="on the host"):
            buf.low_latency_dispatch(_fake_cuda((2, 128), torch.bfloat16), idx, 2, 2)
        y = _fake_cuda(tuple(recv.shape), torch.bfloat16)
        w = _fake_cuda((2, 2), torch.float32)
        with pytest.raises(RuntimeError, match="runs on CPU tensors"):
            buf.low_latency_combine(y, _fake_cuda((2, 2), torch.int64), w, handle)
        out, _, _ = buf.low_latency_combine(recv, idx, torch.ones(2, 2), handle)
        assert out.shape == (2, 128)
    (tmp_path / "b").mkdir()
    with _buffer(tmp_path / "b") as buf:
        buf._mode = "cuda"  # as after a CUDA dispatch
        with pytest.raises(RuntimeError, match="runs on CUDA tensors"):
            buf.low_latency_dispatch(x, idx, 2, 2)
