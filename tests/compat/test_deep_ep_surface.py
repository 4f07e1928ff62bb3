"""The DeepEP surface the pinned engines use (vLLM 0.33.0, SGLang 0.5.23), on
moecomm.compat.deep_ep: the module's names (exactly DeepEP's ``__init__`` exports), ``Config``,
``EventOverlap``, the Buffer's static helpers and config tables, every engine call bound against
our signatures, the refusals by name, and the top-k taken per call (host path between rank
processes, bit-exact against the reference; CUDA path's glue with stand-in kernels)."""

from __future__ import annotations

import inspect
import time
import traceback
import types

import moecomm
import pytest
import torch
import torch.distributed as dist
from deep_ep_procs import (
    EXPERTS_PER_RANK,
    HIDDEN,
    TIMEOUT_S,
    M,
    _source_rows,
    check_dispatch,
    expert_output,
    launch,
    make_inputs,
)
from moecomm.compat import deep_ep
from moecomm.compat.deep_ep import Buffer, Config, EventHandle, EventOverlap

# DeepEP's deep_ep/__init__.py at github.com/deepseek-ai/DeepEP commit
# dd758caf451848bd150e1046af3d0a73e5fff38d (v2.1.0): the names it binds after initialisation
# ("Import APIs after initialisation"). It has no __all__; its namespace also holds the
# initialisation's own helpers (os, torch, glob, subprocess, filecmp, functools, find_nccl_root,
# find_cuda_home, check_nccl_so, init_jit), its subpackages and __version__: not API, and
# moecomm exports none of them, nor any helper of its own.
DEEPEP_INIT_EXPORTS = {
    "Buffer",
    "ElasticBuffer",
    "EPHandle",
    "EventOverlap",
    "EventHandle",
    "get_physical_domain_size",
    "get_logical_domain_size",
    "Config",
    "topk_idx_t",
}


def test_module_exports_exactly_deepeps_names():
    assert set(deep_ep.__all__) == DEEPEP_INIT_EXPORTS
    assert len(deep_ep.__all__) == len(DEEPEP_INIT_EXPORTS)
    # Every attribute but the dunders: no helper, no imported module, no private name (and no
    # submodule left behind by the imports of the implementation).
    assert {n for n in dir(deep_ep) if not n.startswith("__")} == DEEPEP_INIT_EXPORTS
    assert deep_ep.topk_idx_t is torch.int64
    for name in ("ElasticBuffer", "EPHandle", "Config", "EventOverlap", "EventHandle", "Buffer"):
        assert isinstance(getattr(deep_ep, name), type)
    # vLLM's annotations: `deep_ep.Config | None`.
    assert (deep_ep.Config | None) is not None


# ---------------------------------------------------------------------------- Config
def test_config_is_deepeps():
    c = Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (
        20,
        6,
        256,
    )
    # The RDMA receive chunk is aligned up to the send chunk (config.hpp): 256 -> 258.
    assert (c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (6, 258)
    assert Config(24, 6, 256, 6, 128).num_max_rdma_chunked_recv_tokens == 132
    # SGLang builds it from JSON: Config(**{"num_sms": ..., ...}).
    kw = dict(
        num_sms=24,
        num_max_nvl_chunked_send_tokens=8,
        num_max_nvl_chunked_recv_tokens=256,
        num_max_rdma_chunked_send_tokens=16,
        num_max_rdma_chunked_recv_tokens=128,
    )
    assert Config(**kw) == Config(24, 8, 256, 16, 128)
    for bad in ((-1, 6, 256, 6, 256), (20, 0, 256, 6, 256), (20, 256, 256, 6, 256),
                (20, 6, 256, 8, 8)):  # fmt: skip
        with pytest.raises(ValueError, match=r"deep_ep\.Config"):
            Config(*bad)
    with pytest.raises(TypeError):
        Config(20.0)


def test_config_size_hints_are_deepeps_formulas():
    c = Config(20, 6, 256, 6, 128)
    hidden_bytes = 7168 * 2
    # csrc/legacy/config.hpp, 8 ranks: 10 channels x 8 NVL ranks, 1 RDMA rank; 128 top-k slots
    # of int64 ids and f32 weights, 128 f32 scales, 8-byte source metadata per token.
    per, recv = 10 * 8, 256
    want = per * 5 * 4 + per * recv * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)
    assert c.get_nvl_buffer_size_hint(hidden_bytes, 8) == (want + 127) // 128 * 128
    assert c.get_rdma_buffer_size_hint(hidden_bytes, 8) == 0
    per, recv = 10 * 2, 132  # 16 ranks: 2 RDMA ranks
    want = per * 18 * 2 * 4 + per * recv * 2 * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16)
    assert c.get_rdma_buffer_size_hint(hidden_bytes, 16) == (want + 127) // 128 * 128
    with pytest.raises(ValueError):
        c.get_nvl_buffer_size_hint(hidden_bytes, 12)


# DeepEP's deep_ep/buffers/legacy.py tables (nvl send, nvl recv, rdma send, rdma recv given).
DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128),
            16: (36, 288, 20, 128), 24: (32, 288, 8, 128), 32: (32, 288, 8, 128),
            48: (32, 288, 8, 128), 64: (32, 288, 8, 128), 96: (20, 480, 12, 128),
            128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}  # fmt: skip
COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128),
           16: (4, 288, 12, 128), 24: (1, 288, 8, 128), 32: (1, 288, 8, 128),
           48: (1, 288, 8, 128), 64: (1, 288, 8, 128), 96: (1, 480, 8, 128),
           128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}  # fmt: skip


def test_recommended_configs_and_set_num_sms(monkeypatch):
    monkeypatch.setattr(Buffer, "num_sms", Buffer.num_sms)  # restored afterwards
    assert Buffer.num_sms == 20
    tables = ((DISPATCH, Buffer.get_dispatch_config), (COMBINE, Buffer.get_combine_config))
    for table, get in tables:
        assert set(table) == {2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160}
        for n, row in table.items():
            assert get(n) == Config(20, *row), n
    Buffer.set_num_sms(24)  # a class attribute, as in DeepEP (vLLM: deep_ep.Buffer.set_num_sms)
    assert Buffer.num_sms == 24 and Buffer.get_dispatch_config(8).num_sms == 24
    with pytest.raises(ValueError, match="even"):
        Buffer.set_num_sms(23)
    with pytest.raises(ValueError, match="Unsupported number of EP ranks: 3"):
        Buffer.get_combine_config(3)
    assert Buffer.is_sm90_compiled() is True


# ---------------------------------------------------------------------------- events
def test_event_overlap_is_deepeps():
    ev = Buffer.capture()  # DeepEP: EventOverlap(EventHandle()), a staticmethod
    assert isinstance(ev, EventOverlap) and isinstance(ev.event, EventHandle)
    if not torch.cuda.is_initialized():  # nothing on a device to wait for
        assert ev.event.event is None
    ev.current_stream_wait()
    calls = []

    class Handle:
        def current_stream_wait(self):
            calls.append("wait")

    ev = EventOverlap(Handle(), extra_tensors=(torch.zeros(1),))
    ev.register_hook_after_wait(lambda: calls.append("hook"))
    with pytest.raises(RuntimeError, match="already registered"):
        ev.register_hook_after_wait(lambda: None)
    ev.current_stream_wait()
    assert calls == ["wait", "hook"] and ev.event is not None
    with ev(release_handle=True):
        calls.append("body")
    assert calls == ["wait", "hook", "body", "wait"] and ev.event is None
    # A host call's event: vLLM checks `event.event is not None` before waiting; SGLang waits.
    done = EventOverlap()
    assert done.event is None and done.extra_tensors is None
    done.current_stream_wait()
    with done:
        pass
    assert deep_ep.ElasticBuffer.capture().event is not None


def test_domain_sizes():
    group = types.SimpleNamespace(size=lambda: 4)
    assert deep_ep.get_physical_domain_size(group) == (1, 4)
    assert deep_ep.get_logical_domain_size(group, allow_hybrid_mode=False) == (1, 4)


# ---------------------------------------------------------------------------- engine calls
ANY = object()  # any value: only the binding to our signatures is checked here
# (where, the call as made, positional count, keywords), from the engines' sources.
ENGINE_CALLS = [
    # vLLM all2all.py: DeepEPLLAll2AllManager / DeepEPHTAll2AllManager
    ("vllm", "get_low_latency_rdma_size_hint", 0,
     ["num_max_dispatch_tokens_per_rank", "hidden", "num_ranks", "num_experts"]),
    ("vllm", "__init__", 0, ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode",
                             "num_qps_per_rank", "allow_nvlink_for_low_latency_mode",
                             "allow_mnnvl", "explicitly_destroy", "enable_shrink"]),
    ("vllm", "set_num_sms", 1, []),
    ("vllm", "get_dispatch_config", 1, []),
    ("vllm", "get_combine_config", 1, []),
    ("vllm", "capture", 0, []),
    ("vllm", "low_latency_query_mask_buffer", 1, []),
    ("vllm", "get_local_buffer_tensor", 0, ["dtype", "use_rdma_buffer"]),
    ("vllm", "low_latency_clean_mask_buffer", 0, []),
    ("vllm", "destroy", 0, []),
    # vLLM deepep_ht.py
    ("vllm", "get_dispatch_layout", 0,
     ["topk_idx", "num_experts", "previous_event", "async_finish", "allocate_on_comm_stream"]),
    ("vllm", "dispatch", 0, ["x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank",
                             "is_token_in_rank", "num_tokens_per_expert", "topk_idx",
                             "topk_weights", "expert_alignment", "config", "previous_event",
                             "async_finish", "allocate_on_comm_stream"]),
    ("vllm", "combine", 0, ["x", "handle", "topk_weights", "config", "previous_event",
                            "async_finish", "allocate_on_comm_stream"]),
    # vLLM deepep_ll.py (use_nvfp4 / x_global_scale only with VLLM_DEEPEPLL_NVFP4_DISPATCH)
    ("vllm", "low_latency_dispatch", 4, ["use_fp8", "round_scale", "use_ue8m0", "use_nvfp4",
                                         "x_global_scale", "async_finish", "return_recv_hook"]),
    ("vllm", "low_latency_combine", 4,
     ["async_finish", "zero_copy", "return_recv_hook", "out"]),
    # SGLang token_dispatcher/deepep.py
    ("sglang", "__init__", 3, ["low_latency_mode", "num_qps_per_rank", "allow_mnnvl",
                               "use_fabric"]),
    ("sglang", "get_low_latency_rdma_size_hint", 4, []),
    ("sglang", "clean_low_latency_buffer", 3, []),
    ("sglang", "get_dispatch_layout", 2,
     ["previous_event", "async_finish", "allocate_on_comm_stream"]),
    ("sglang", "dispatch", 1, ["topk_idx", "topk_weights", "num_tokens_per_rank",
                               "num_tokens_per_rdma_rank", "is_token_in_rank",
                               "num_tokens_per_expert", "previous_event", "async_finish",
                               "allocate_on_comm_stream", "expert_alignment", "config"]),
    ("sglang", "combine", 2,
     ["async_finish", "previous_event", "allocate_on_comm_stream", "config"]),
    ("sglang", "low_latency_dispatch", 4, ["use_fp8", "use_nvfp4", "x_global_scale",
                                           "async_finish", "return_recv_hook", "round_scale",
                                           "use_ue8m0"]),
    ("sglang", "low_latency_combine", 0, ["x", "topk_idx", "topk_weights", "handle",
                                          "async_finish", "return_recv_hook"]),
    # SGLang single-batch overlap (a DeepEP fork's keywords; refused when overlap=True)
    ("sglang", "low_latency_combine", 4, ["overlap", "src_signals", "src_signal_expect_value"]),
    ("sglang", "low_latency_combine", 4, ["overlap", "packed_recv_count", "comp_signal",
                                          "block_m", "threshold", "num_sms"]),
]  # fmt: skip
ELASTIC_CALLS = [
    ("vllm", "__init__", 0, ["group", "num_max_tokens_per_rank", "hidden", "num_topk",
                             "use_fp8_dispatch", "allow_hybrid_mode",
                             "prefer_overlap_with_compute", "allow_multiple_reduction",
                             "explicitly_destroy"]),
    ("vllm", "get_theoretical_num_sms", 0, ["num_experts", "num_topk"]),
    ("vllm", "dispatch", 0, ["x", "topk_idx", "topk_weights", "num_experts",
                             "num_max_tokens_per_rank", "do_expand", "do_cpu_sync",
                             "async_with_compute_stream"]),
    ("vllm", "combine", 0, ["x", "handle", "topk_weights", "async_with_compute_stream",
                            "allocate_on_comm_stream"]),
    ("sglang", "__init__", 1, ["num_max_tokens_per_rank", "hidden", "num_topk",
                               "use_fp8_dispatch", "allow_hybrid_mode", "sl_idx",
                               "prefer_overlap_with_compute"]),
    ("sglang", "dispatch", 1, ["topk_idx", "topk_weights", "num_experts",
                               "num_max_tokens_per_rank", "expert_alignment", "num_sms",
                               "use_tma_aligned_col_major_sf", "do_cpu_sync", "do_expand"]),
    ("sglang", "combine", 1, ["handle", "topk_weights"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "engine", "method", "npos", "keywords"),
    [(Buffer, *c) for c in ENGINE_CALLS] + [(deep_ep.ElasticBuffer, *c) for c in ELASTIC_CALLS],
)
def test_every_engine_call_binds_to_our_signature(cls, engine, method, npos, keywords):
    sig = inspect.signature(getattr(cls, method))
    args = [ANY] * npos
    if method == "__init__" or not isinstance(inspect.getattr_static(cls, method), staticmethod):
        args = [ANY, *args]  # self
    sig.bind(*args, **dict.fromkeys(keywords, ANY))


# Attributes the engines read (besides calls): vLLM event.event, handle fields; SGLang
# buffer.group_size / low_latency_mode, Buffer.num_sms, ElasticBuffer.num_bytes.
def test_attributes_the_engines_read(tmp_path):
    store = dist.FileStore(str(tmp_path / "s"), 1)
    with Buffer(None, 0, 0, True, rank=0, num_ranks=1, store=store, timeout=5) as buf:
        assert (buf.group_size, buf.rank, buf.low_latency_mode) == (1, 0, True)
        assert buf.num_sms == Buffer.num_sms == 20
        assert buf.capture().event is not None  # vLLM calls it through the instance
    with deep_ep.ElasticBuffer(
        rank=0, num_ranks=1, store=dist.FileStore(str(tmp_path / "e"), 1), timeout=5
    ) as eb:
        assert isinstance(eb.num_bytes, int)
        assert eb.get_theoretical_num_sms(num_experts=8, num_topk=2) >= 1
    for attr in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                 "num_recv_tokens_per_expert_list"):  # fmt: skip
        assert attr in deep_ep.EPHandle.__annotations__


def test_refusals_name_the_call(tmp_path):
    store = dist.FileStore(str(tmp_path / "s"), 1)
    e = 2
    with Buffer(None, low_latency_mode=True, rank=0, num_ranks=1, store=store, timeout=5) as buf:
        # vLLM's fault-tolerance retry (DeepEPLLAll2AllManager.clean_buffers).
        for rdma in (True, False):
            with pytest.raises(NotImplementedError, match="get_local_buffer_tensor") as info:
                buf.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=rdma)
            assert "not one region" in str(info.value)
        with pytest.raises(NotImplementedError, match="get_comm_stream"):
            buf.get_comm_stream()
        for name in ("internode_dispatch", "internode_combine"):
            with pytest.raises(NotImplementedError, match=name):
                getattr(buf, name)(None, None)
        x, idx, w = make_inputs(0, 0, 4, e, masked=0, topk=2)
        with pytest.raises(NotImplementedError, match="use_nvfp4=True"):
            buf.low_latency_dispatch(x, idx, M, e, use_nvfp4=True)
        with pytest.raises(NotImplementedError, match="x_global_scale"):
            buf.low_latency_dispatch(x, idx, M, e, x_global_scale=torch.ones(e))
        recv, _, handle, event, _ = buf.low_latency_dispatch(x, idx, M, e, use_fp8=False)
        assert event.event is None  # a host call: complete
        with pytest.raises(NotImplementedError, match="overlap=True"):
            buf.low_latency_combine(recv, idx, w, handle, overlap=True, comp_signal=ANY)
        # overlap=False: the fork's other keywords change nothing.
        out, _, _ = buf.low_latency_combine(recv, idx, w, handle, overlap=False, num_sms=3)
        assert out.shape == (4, HIDDEN)
        # The normal mode on device tensors (vLLM's deepep_high_throughput on GPUs).
        on_device = torch.zeros(4, 2, dtype=torch.int64, device="meta")
        with pytest.raises(NotImplementedError, match="get_dispatch_layout / dispatch"):
            buf.get_dispatch_layout(on_device, e)
        # The buffer still works after the refusals.
        assert buf.low_latency_dispatch(x, idx, M, e, use_fp8=False)[1].sum() > 0


# ---------------------------------------------------------------------------- top-k per call
def _round(buf, seed: int, ks: list[int], use_fp8: bool, hook: bool = False, keep=None):
    """One dispatch + combine on every rank, rank p with top-k ks[p]; checked bit for bit."""
    nr, r = buf.num_ranks, buf.rank
    e_total = EXPERTS_PER_RANK * nr
    inputs = [make_inputs(seed, p, M - p, e_total, topk=ks[p]) for p in range(nr)]
    x, idx, _ = inputs[r]
    recv_x, count, handle, _, h = buf.low_latency_dispatch(
        x, idx, M, e_total, use_fp8=use_fp8, return_recv_hook=hook
    )
    if hook:
        h()
    y = check_dispatch(buf, inputs, recv_x, count, handle, use_fp8)
    if keep is not None:  # combined later by the caller
        keep.append((inputs, y.clone(), handle, use_fp8))
        return
    _combine_and_check(buf, inputs, y, handle, use_fp8)


def _combine_and_check(buf, inputs, y, handle, use_fp8):
    x, idx, w = inputs[buf.rank]
    out, _, _ = buf.low_latency_combine(y, idx, w, handle)
    _, _, deq = _source_rows(x, use_fp8)
    ref = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            if int(idx[t, k]) >= 0:
                ref[t] = ref[t] + w[t, k] * expert_output(deq[t], int(idx[t, k])).float()
    assert torch.equal(out, ref.to(torch.bfloat16)), f"rank {buf.rank}: combine differs"


def _grow_scenario(buf) -> None:
    nr = buf.num_ranks
    e_total = EXPERTS_PER_RANK * nr
    _round(buf, 1, [2] * nr, True)
    assert buf.shape.num_topk == 2
    _round(buf, 2, [4] * nr, True)  # larger: the slots are re-sized (a rendezvous)
    assert buf.shape.num_topk == 4
    _round(buf, 3, [1] * nr, False, hook=True)  # smaller: the same slots
    _round(buf, 4, [3] * nr, True)
    assert buf.shape.num_topk == 4
    # The ranks need not agree on the top-k of a call (within the slots' size).
    _round(buf, 5, [1, 4, 2][:nr], True)
    # A re-size waits for nothing in flight: refused while a receive hook is pending.
    x, idx, _ = make_inputs(6, buf.rank, M, e_total, topk=4)
    pending = buf.low_latency_dispatch(x, idx, M, e_total, return_recv_hook=True)
    x8, idx8, _ = make_inputs(7, buf.rank, M, e_total, topk=8)
    try:
        buf.low_latency_dispatch(x8, idx8, M, e_total)
        raise AssertionError("a re-size with a receive pending was not refused")
    except RuntimeError as exc:
        assert "in flight" in str(exc) and "num_topk=8" in str(exc), exc
    pending[4]()
    # A handle received before the re-size, combined after it (through the new slots).
    kept: list = []
    _round(buf, 8, [2] * nr, False, keep=kept)
    _round(buf, 9, [8] * nr, True)  # top-k 8 = every expert of the 2-rank group
    assert buf.shape.num_topk == 8
    _combine_and_check(buf, *kept[0])
    _round(buf, 10, [5] * nr, False)


def _preset_scenario(buf) -> None:
    nr = buf.num_ranks
    assert buf.shape.num_topk == 6  # given at construction: the largest top-k
    for seed, k in ((11, 6), (12, 2), (13, 5)):
        _round(buf, seed, [k] * nr, True)
    assert buf.shape.num_topk == 6


def _sglang_auto_scenario(buf) -> None:
    """SGLang's DeepEP "auto" mode on one buffer: normal-mode calls (its keywords, DeepEP's
    recommended configs, Buffer.capture as previous_event), then clean_low_latency_buffer
    before the low-latency calls, whose top-k differs from the normal calls'."""
    nr, r = buf.num_ranks, buf.rank
    e_total = EXPERTS_PER_RANK * nr
    x, idx, w = make_inputs(21, r, M - r, e_total, topk=4)
    prev = Buffer.capture()
    n_rank, n_rdma, n_expert, in_rank, prev = buf.get_dispatch_layout(
        idx, e_total, previous_event=prev, async_finish=True, allocate_on_comm_stream=True
    )
    assert n_rdma is None
    recv_x, recv_idx, recv_w, per_expert, handle, event = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=n_rank,
        num_tokens_per_rdma_rank=n_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=n_expert, previous_event=prev, async_finish=True,
        allocate_on_comm_stream=True, expert_alignment=1,
        config=Buffer.get_dispatch_config(nr),
    )  # fmt: skip
    event.current_stream_wait()
    assert isinstance(per_expert, list) and sum(per_expert) == int((recv_idx >= 0).sum())
    assert recv_w.shape == recv_idx.shape
    combined, _, event = buf.combine(
        recv_x, handle, async_finish=True, previous_event=Buffer.capture(),
        allocate_on_comm_stream=True, config=Buffer.get_combine_config(nr),
    )  # fmt: skip
    event.current_stream_wait()
    # Each rank sent its rows back unchanged: token t comes back once per rank it went to.
    copies = in_rank.sum(1, keepdim=True).float()
    assert torch.equal(combined, (x.float() * copies).to(torch.bfloat16))
    buf.clean_low_latency_buffer(M, HIDDEN, e_total)
    _round(buf, 22, [2] * nr, True, hook=True)
    _round(buf, 23, [3] * nr, False)


def _process_group_scenario(buf, store_path: str) -> None:
    """vLLM's way: a Buffer on a gloo group (lazily set up, a top-k growing over its calls)."""
    nr, r = buf.num_ranks, buf.rank
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path + ".pg", nr), rank=r, world_size=nr
    )
    try:
        vllm_kwargs = dict(
            num_nvl_bytes=0, num_rdma_bytes=1 << 20, low_latency_mode=True, num_qps_per_rank=4,
            allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True,
            enable_shrink=False,
        )  # fmt: skip
        with Buffer(dist.group.WORLD, **vllm_kwargs, timeout=TIMEOUT_S) as b2:
            _round(b2, 31, [2] * nr, True)
            _round(b2, 32, [6] * nr, True, hook=True)
            assert b2.shape.num_topk == 6
            _round(b2, 33, [1] * nr, False)
    finally:
        dist.destroy_process_group()


SCENARIOS = {"grow": _grow_scenario, "preset": _preset_scenario, "sglang": _sglang_auto_scenario}


def topk_rank(rank: int, num_ranks: int, store_path: str, names: list[str], conn) -> None:
    torch.set_num_threads(1)
    results = {}
    store = dist.FileStore(store_path, num_ranks)
    for name in names:
        t0 = time.monotonic()
        kw = {}
        if name == "preset":
            kw = dict(num_max_dispatch_tokens_per_rank=M, hidden=HIDDEN,
                      num_experts=EXPERTS_PER_RANK * num_ranks, num_topk=6)  # fmt: skip
        try:
            kw.update(rank=rank, num_ranks=num_ranks, store=store, store_prefix=f"surface/{name}")
            with Buffer(None, low_latency_mode=True, timeout=TIMEOUT_S, **kw) as buf:
                if name == "process_group":
                    _process_group_scenario(buf, store_path)
                else:
                    SCENARIOS[name](buf)
            results[name] = ("ok", time.monotonic() - t0)
        except BaseException:
            results[name] = (traceback.format_exc(), time.monotonic() - t0)
            break
    conn.send(results)


@pytest.mark.timeout(300)
def test_topk_per_call_between_ranks(tmp_path):
    reaped = []

    class Reaper:
        def process(self, p):
            reaped.append(p)
            return p

    names = ["grow", "preset", "sglang", "process_group"]
    try:
        results = launch(2, str(tmp_path / "store"), names, Reaper(), 200, target=topk_rank)
    finally:
        for p in reaped:
            if p.is_alive():
                p.kill()  # a forked one may be reaped already
            p.join(5)
            moecomm.reap_stale_segments(p.pid)
    for name in names:
        for rank, res in enumerate(results):
            status = res.get(name, ("not run (an earlier one failed)", 0.0))[0]
            assert status == "ok", f"rank {rank}, {name}:\n{status}"


# The CUDA path's glue, with the stand-in kernels of test_deep_ep_device_glue.py.
from test_deep_ep_device_glue import _all, _check_receive, _dispatch, glue  # noqa: E402, F401
from test_deep_ep_device_host import H, K, R, _expert_output, _inputs, _source  # noqa: E402
from test_deep_ep_device_host import M as GLUE_M  # noqa: E402


def test_device_path_takes_a_smaller_topk_and_refuses_a_larger_one(glue):  # noqa: F811
    bufs, _ = glue
    for seed, k in ((1, K), (2, K - 1), (3, 1), (4, K)):
        full = [_inputs(seed, p, n) for p, n in enumerate([GLUE_M, 0, 4])]
        inputs = [(x, idx[:, :k].contiguous(), w[:, :k].contiguous()) for x, idx, w in full]
        got = _all(lambda r, i=inputs: _dispatch(bufs[r], *i[r][:2], True, False))
        sources = [_source(x, True) for x, _, _ in inputs]
        ys = _check_receive(got, inputs, sources, True)
        outs = _all(
            lambda r, i=inputs, g=got, y=ys: bufs[r].low_latency_combine(y[r], *i[r][1:], g[r][2])
        )
        for r, (out, _, _) in enumerate(outs):
            x, idx, w = inputs[r]
            ref = torch.zeros(x.shape[0], H)
            for t in range(x.shape[0]):
                for j in range(k):
                    if int(idx[t, j]) >= 0:
                        ref[t] += w[t, j] * _expert_output(sources[r][2][t], int(idx[t, j])).float()
            assert torch.equal(out, ref.to(torch.bfloat16)), f"rank {r}, top-k {k}"
    assert all(b.shape.num_topk == K for b in bufs)
    x = torch.zeros(2, H, dtype=torch.bfloat16)
    wide = torch.arange(K + 1).repeat(2, 1)
    with pytest.raises(NotImplementedError, match=f"num_topk={K + 1}"):
        _dispatch(bufs[0], x, wide)
    assert R == 3
