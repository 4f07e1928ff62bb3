"""DeepEP's low-latency contract, scenario by scenario, as its own test
(``tests/legacy/test_low_latency.py`` of deepseek-ai/DeepEP) walks it: several ranks as
processes, DeepEP's hidden sizes (2048, 4096, 7168) at CPU-sized token counts, top-8, every flag
(fp8, round_scale, UE8M0, hooks, zero-copy, LogFMT, shrink), dispatches left uncombined, a
handle combined twice. Each result is checked with DeepEP's own assertions and against an
independent plain-torch reference (deep_ep_ll_contract_procs.py).

Plus the one-process contract: signatures identical to DeepEP's, the module's ``topk_idx_t``,
the fp8 cast's formula on all-zero and tiny blocks, the mask API."""

import inspect

import moecomm
import pytest
import torch
import torch.distributed as dist
from deep_ep_ll_contract_procs import CONFIGS, contract_rank
from deep_ep_procs import deepep_fp8, launch
from moecomm.compat import deep_ep
from moecomm.compat.deep_ep import Buffer
from moecomm.compat.low_latency.cast import deepep_cast, logfmt_roundtrip, pack_ue8m0

GROUPS = (
    (4, ["main_h2048", "logfmt_h4096", "ragged_h7168"]),
    (8, ["shrink_h7168_e288"]),
)
GROUP_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out, reaped = {}, []

    class Reaper:
        def process(self, p):
            reaped.append(p)
            return p

    try:
        for num_ranks, names in GROUPS:
            path = str(tmp_path_factory.mktemp(f"contract{num_ranks}") / "store")
            results = launch(
                num_ranks, path, names, Reaper(), GROUP_TIMEOUT_S, target=contract_rank
            )
            for name in names:
                out[name] = [r.get(name, ("not run (an earlier one failed)", 0.0)) for r in results]
    finally:
        for p in reaped:
            if p.is_alive():
                p.kill()  # a forked one may be reaped already
            p.join(5)
            moecomm.reap_stale_segments(p.pid)
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [n for _, names in GROUPS for n in names])
def test_deepep_low_latency_scenario(runs, name):
    assert name in CONFIGS
    for rank, (status, _) in enumerate(runs[name]):
        assert status == "ok", f"rank {rank}, scenario {name}:\n{status}"


# ---------------------------------------------------------------------------- one process
# DeepEP dd758ca, deep_ep/buffers/legacy.py: names, order and defaults.
DEEPEP_SIGNATURES = {
    "__init__": [
        ("group", inspect.Parameter.empty),
        ("num_nvl_bytes", 0),
        ("num_rdma_bytes", 0),
        ("low_latency_mode", False),
        ("num_qps_per_rank", 24),
        ("allow_nvlink_for_low_latency_mode", True),
        ("allow_mnnvl", False),
        ("explicitly_destroy", False),
        ("enable_shrink", False),
        ("comm", None),
    ],
    "low_latency_dispatch": [
        ("x", inspect.Parameter.empty),
        ("topk_idx", inspect.Parameter.empty),
        ("num_max_dispatch_tokens_per_rank", inspect.Parameter.empty),
        ("num_experts", inspect.Parameter.empty),
        ("cumulative_local_expert_recv_stats", None),
        ("dispatch_wait_recv_cost_stats", None),
        ("use_fp8", True),
        ("round_scale", False),
        ("use_ue8m0", False),
        ("async_finish", False),
        ("return_recv_hook", False),
    ],
    "low_latency_combine": [
        ("x", inspect.Parameter.empty),
        ("topk_idx", inspect.Parameter.empty),
        ("topk_weights", inspect.Parameter.empty),
        ("handle", inspect.Parameter.empty),
        ("use_logfmt", False),
        ("zero_copy", False),
        ("async_finish", False),
        ("return_recv_hook", False),
        ("out", None),
        ("combine_wait_recv_cost_stats", None),
    ],
    "clean_low_latency_buffer": [
        ("num_max_dispatch_tokens_per_rank", inspect.Parameter.empty),
        ("hidden", inspect.Parameter.empty),
        ("num_experts", inspect.Parameter.empty),
    ],
    "get_next_low_latency_combine_buffer": [("handle", inspect.Parameter.empty)],
    "low_latency_update_mask_buffer": [
        ("rank_to_mask", inspect.Parameter.empty),
        ("mask", False),
    ],
    "low_latency_query_mask_buffer": [("mask_status", inspect.Parameter.empty)],
    "low_latency_clean_mask_buffer": [],
    "get_low_latency_rdma_size_hint": [
        ("num_max_dispatch_tokens_per_rank", inspect.Parameter.empty),
        ("hidden", inspect.Parameter.empty),
        ("num_ranks", inspect.Parameter.empty),
        ("num_experts", inspect.Parameter.empty),
    ],
}


@pytest.mark.parametrize("method", list(DEEPEP_SIGNATURES))
def test_signature_is_deepeps(method):
    params = [
        p
        for p in inspect.signature(getattr(Buffer, method)).parameters.values()
        if p.name != "self"
    ]
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    got = [(p.name, p.default) for p in positional]
    assert got == DEEPEP_SIGNATURES[method]
    # moecomm's own options come after, keyword-only.
    assert all(p.kind == p.KEYWORD_ONLY for p in params[len(positional) :])


def test_module_exports_topk_idx_t():
    assert deep_ep.topk_idx_t is torch.int64


def test_fp8_cast_is_deepeps_formula_on_zero_tiny_and_saturating_blocks():
    x = torch.randn(5, 512).to(torch.bfloat16)
    x[0] = 0  # all-zero blocks: amax clamps at 1e-4, scale_inv 1e-4 * f32(1/448), bytes 0
    x[1, :128] = 1e-7  # below the 1e-4 margin: amax is 1e-4, so it is NOT scaled up to 448
    x[1, 128:256] = 1e-3  # above it: scaled up to 448 like any other block
    x[2, :128] = torch.linspace(-3, 3, 128).to(torch.bfloat16)
    x[3] = 448 * 4
    for round_scale in (False, True):
        q, inv = deepep_cast(x, round_scale)
        rq, rinv, _ = deepep_fp8(x, round_scale)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(inv, rinv)
        assert bool((q[0].view(torch.uint8) == 0).all())
        want0 = torch.tensor(1e-4) * torch.tensor(1 / 448, dtype=torch.float32)
        if not round_scale:
            assert torch.equal(inv[0], want0.expand(4))
            tiny = float(x[1, 0]) * 448 / 1e-4
            assert float(q[1, 0].float()) == pytest.approx(tiny, rel=0.07)
            assert float(q[1, 128].float()) == 448.0
        else:
            assert bool((torch.frexp(inv)[0] == 0.5).all())
        assert bool((q[3].float() == 448).all())
    packed = pack_ue8m0(deepep_cast(x, True)[1])
    assert packed.dtype == torch.int32 and packed.shape == (5, 1)
    b = packed.view(torch.uint8).view(5, 4)
    assert torch.equal(b.to(torch.int64) - 127, torch.frexp(deepep_cast(x, True)[1])[1] - 1)


def test_logfmt_round_trip_bounds_and_passthrough():
    y = torch.randn(3, 256).mul(0.05).to(torch.bfloat16)
    y[1, :128] = y[1, :128] * 100 + 3  # amax >= 1: travels as bf16 unchanged
    y[2, 128:] = 0  # all zero: unchanged
    d = logfmt_roundtrip(y)
    assert torch.equal(d[1, :128], y[1, :128].float())
    assert torch.equal(d[2, 128:], torch.zeros(128))
    cast = torch.cat([d[0], d[2, :128]])
    ref = torch.cat([y[0], y[2, :128]]).float()
    # 9-bit codes over at most 32 octaves: relative error below half a step (2^(32/510)).
    assert bool(((cast - ref).abs() <= ref.abs() * (2 ** (32 / 510) - 1)).all())
    assert torch.equal(torch.signbit(cast[ref != 0]), torch.signbit(ref[ref != 0]))


def test_mask_api_needs_shrink_and_round_trips(tmp_path):
    store = dist.FileStore(str(tmp_path / "s"), 1)
    plain = Buffer(None, low_latency_mode=True, rank=0, num_ranks=1, store=store)
    with plain, pytest.raises(RuntimeError, match="Shrink mode"):
        plain.low_latency_update_mask_buffer(0, True)
    store = dist.FileStore(str(tmp_path / "s2"), 1)
    with Buffer(None, 0, 0, True, enable_shrink=True, rank=0, num_ranks=1, store=store) as b:
        status = torch.zeros(1, dtype=torch.int)
        b.low_latency_update_mask_buffer(0, True)
        b.low_latency_query_mask_buffer(status)
        assert status.tolist() == [1]
        b.low_latency_clean_mask_buffer()
        b.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0]
        with pytest.raises(TypeError, match=r"torch\.int"):
            b.low_latency_query_mask_buffer(torch.zeros(1))


class _OneRankComm:
    """An mpi4py-like communicator of one rank (DeepEP's ``comm=`` path)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, obj):
        return [obj]


def test_mpi_comm_rendezvous_and_a_round_trip():
    e, m, h = 4, 3, 256
    shape = dict(num_max_dispatch_tokens_per_rank=m, hidden=h, num_experts=e, num_topk=2)
    with Buffer(None, low_latency_mode=True, comm=_OneRankComm(), timeout=5, **shape) as buf:
        x = torch.randn(m, h).to(torch.bfloat16)
        idx = torch.tensor([[0, 3], [-1, 1], [2, -1]])
        w = torch.rand(m, 2)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, m, e, use_fp8=False)
        assert count.tolist() == [1, 1, 1, 1]
        out, _, _ = buf.low_latency_combine(recv, idx, w, handle)
        want = torch.zeros(m, h)
        for k in range(2):
            want = torch.where((idx[:, k] >= 0)[:, None], want + w[:, k : k + 1] * x.float(), want)
        assert torch.equal(out, want.to(torch.bfloat16))
    with pytest.raises(ValueError, match="not both"):
        Buffer(None, comm=_OneRankComm(), rank=0, num_ranks=1, store=object())
