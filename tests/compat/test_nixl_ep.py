"""moecomm.compat.nixl_ep: NIXL-EP's ``Buffer`` (github.com/ai-dynamo/nixl examples/device/ep,
nixl_ep/buffer.py) on moecomm, as vLLM's NixlEPAll2AllManager and NixlEPPrepareAndFinalize drive
it.

Two groups of spawned rank processes (nixl_ep_procs.py), every result bit-exact against a plain
torch reference of NIXL-EP's semantics:

- *elastic* (capacity 4, a TCPStore on loopback): ranks 0-2 serve (bf16 / fp8, hooks,
  ``num_experts`` None and vLLM's ``expert_capacity``, zero-copy, stats, barrier); each masks the
  others and runs alone a different number of rounds (vLLM's ``mask_remote_ranks``), then they
  meet again; rank 3 connects later (``activate=False`` on the old ranks while they keep serving,
  a warm-up alone, then unmasked at "commit"), serves with them, and is disconnected; rank 2 is
  killed with SIGKILL between its dispatch and its combine: the survivors see it masked
  (``query_mask_buffer``), drop its experts' copies, and after vLLM's ``clean_buffers`` retry
  (which unmasks it) mask it again at the next dispatch.
- *replicas* (3 ranks, a FileStore): a Buffer opted in to moecomm's replicas through
  ``MOECOMM_NIXL_EP_REPLICAS`` next to a plain one; rank 1 is killed mid-round; afterwards the
  replicas Buffer serves its experts from their replicas (bit-equal to the fault-free result for
  every token whose experts all have a live copy) where the plain one drops them.

Plus, in one process: every call vLLM makes binds to our signatures (written out from vLLM's
source), NIXL-EP's signatures and exports, the refusals, the mask rules, the store handshake
against stale keys, get_dispatch_layout, Config.
"""

from __future__ import annotations

import ast
import datetime
import inspect
import threading
import time
from multiprocessing.connection import wait as wait_conns
from unittest import mock

import moecomm
import nixl_ep_procs as procs
import pytest
import torch
import torch.distributed as dist
from moecomm import prefork
from moecomm.compat import nixl_ep
from moecomm.compat.nixl_ep import Buffer, Config, EventOverlap
from moecomm.compat.nixl_ep_impl import buffer as nixl_ep_buffer
from moecomm.compat.nixl_ep_impl import runtime as nixl_ep_runtime
from moecomm.compat.nixl_ep_impl.pairs import handshake
from moecomm.compat.nixl_ep_impl.runtime import SLOT_TOPK

GROUP_TIMEOUT_S = 150


def _launch(target, num_ranks: int, store_spec: tuple, timeout: float) -> dict:
    """{rank: [(phase, status, seconds)]}: each rank's phases until its "end", its death or the
    deadline. Every process is killed and its shared memory reaped at the end."""
    ctx = prefork.process_context()
    procs_, conns = [], {}
    out: dict[int, list] = {r: [] for r in range(num_ranks)}
    try:
        for r in range(num_ranks):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(r, store_spec, child), daemon=True)
            p.start()
            child.close()
            procs_.append(p)
            conns[parent] = r
        deadline = time.monotonic() + timeout
        while conns:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for r in conns.values():
                    out[r].append(("deadline", f"no end within {timeout} s", 0.0))
                break
            for conn in wait_conns(list(conns), timeout=remaining):
                r = conns[conn]
                try:
                    msg = conn.recv()
                except EOFError:
                    out[r].append(("exit", "the process ended", 0.0))
                    del conns[conn]
                    continue
                out[r].append(msg)
                if msg[0] == "end":
                    del conns[conn]
    finally:
        for p in procs_:
            if p.is_alive():
                p.join(5)
            if p.is_alive():
                p.kill()  # a forked one may be reaped already
            p.join(5)
            moecomm.reap_stale_segments(p.pid)
    return out


@pytest.fixture(scope="module")
def elastic():
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    t0 = time.monotonic()
    res = _launch(
        procs.elastic_rank, procs.ELASTIC_RANKS, ("tcp", store.port, None), GROUP_TIMEOUT_S
    )
    return res, time.monotonic() - t0


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("nixl_rep") / "store")
    res = _launch(procs.replicas_rank, procs.REPLICA_RANKS, ("file", path, procs.REPLICA_RANKS),
                  GROUP_TIMEOUT_S)  # fmt: skip
    return res


def _phase(results: dict, rank: int, name: str):
    for phase, status, secs in results[rank]:
        if phase == name:
            return status, secs
    history = "\n".join(f"  {p}: {s.splitlines()[-1] if s else s}" for p, s, _ in results[rank])
    return f"phase {name!r} not run on rank {rank}; it reported:\n{history}", 0.0


ELASTIC_PHASES = {
    "connect": [0, 1, 2, 3],
    "bf16_active_bound": [0, 1, 2],
    "fp8_capacity": [0, 1, 2],
    "barrier": [0, 1, 2],
    "solo": [0, 1, 2],
    "join": [0, 1, 2, 3],
    "leave": [0, 1, 2, 3],
    "kill": [0, 1, 2, 3],
}


@pytest.mark.timeout(GROUP_TIMEOUT_S + 60)
@pytest.mark.parametrize("phase", list(ELASTIC_PHASES))
def test_elastic_group(elastic, phase):
    results, _ = elastic
    for rank in ELASTIC_PHASES[phase]:
        status, _ = _phase(results, rank, phase)
        assert status == "ok", f"rank {rank}, phase {phase}:\n{status}"
    if phase == "kill":  # the victim reported, then died without an "end"
        assert results[procs.VICTIM][-1][0] == "exit"


@pytest.mark.timeout(GROUP_TIMEOUT_S + 60)
@pytest.mark.parametrize("phase", ["connect", "fault_free", "kill", "after"])
def test_replicas_group(replicas, phase):
    ranks = range(procs.REPLICA_RANKS)
    if phase == "after":
        ranks = [r for r in ranks if r != procs.REPLICA_VICTIM]
    for rank in ranks:
        status, _ = _phase(replicas, rank, phase)
        assert status == "ok", f"rank {rank}, phase {phase}:\n{status}"


# ---------------------------------------------------------------------------- signatures
def _sig(fn):
    return inspect.signature(fn)


def test_vllm_calls_bind(tmp_path):
    """Every call NixlEPAll2AllManager (vllm/distributed/device_communicators/all2all.py) and
    NixlEPPrepareAndFinalize (vllm/model_executor/layers/fused_moe/prepare_finalize/nixl_ep.py)
    make, with vLLM's argument names, bound to our signatures."""
    store = dist.FileStore(str(tmp_path / "s"), 1)
    max_num_tokens_per_dp_rank, token_hidden_size, max_num_ep_ranks = 8, 256, 2
    num_experts_per_rank = max_num_global_experts = 4
    ranks_to_connect = ranks_to_disconnect = [0, 1]
    make_active, rank = False, 1
    mask = torch.zeros(2, dtype=torch.int32)
    a1 = torch.zeros(3, 256, dtype=torch.bfloat16)
    dispatch_topk_ids = combine_topk_ids = torch.zeros(3, 2, dtype=torch.int64)
    combine_topk_weights = torch.zeros(3, 2)
    fused_expert_output = output = handle = None
    max_tokens_per_rank, expert_capacity, do_recv_hook = 8, 8, True
    use_fp8_dispatch = use_ue8m0_dispatch = False

    _sig(Buffer.get_rdma_size_hint).bind(
        num_max_dispatch_tokens_per_rank=max_num_tokens_per_dp_rank,
        hidden=token_hidden_size,
        num_ranks=max_num_ep_ranks,
        num_experts=max_num_global_experts,
    )
    _sig(Buffer).bind(rank=0, tcp_store_group=store)
    buffer = Buffer(rank=0, tcp_store_group=store)
    _sig(buffer.update_memory_buffers).bind(
        num_ranks=max_num_ep_ranks,
        num_experts_per_rank=num_experts_per_rank,
        num_rdma_bytes=1 << 20,
    )
    _sig(buffer.connect_ranks).bind(ranks_to_connect)
    _sig(buffer.set_tcp_store_group).bind(store)
    _sig(buffer.connect_ranks).bind(ranks_to_connect, activate=make_active)
    _sig(buffer.disconnect_ranks).bind(ranks_to_disconnect)
    _sig(buffer.update_mask_buffer).bind(rank, mask=False)
    _sig(buffer.update_mask_buffer).bind(rank, mask=True)
    _sig(buffer.set_tcp_store_group).bind(None)
    _sig(buffer.query_mask_buffer).bind(mask)
    _sig(buffer.get_local_buffer_tensor).bind(dtype=torch.int8, use_rdma_buffer=True)
    _sig(buffer.clean_mask_buffer).bind()
    _sig(buffer.dispatch).bind(
        a1,
        dispatch_topk_ids,
        max_tokens_per_rank,
        expert_capacity,
        use_fp8=use_fp8_dispatch,
        round_scale=use_ue8m0_dispatch,
        use_ue8m0=use_ue8m0_dispatch,
        async_finish=False,
        return_recv_hook=True,
    )
    _sig(buffer.combine).bind(
        fused_expert_output,
        combine_topk_ids,
        combine_topk_weights,
        handle,
        async_finish=False,
        zero_copy=False,
        return_recv_hook=do_recv_hook,
        out=output,
    )
    assert getattr(nixl_ep, "topk_idx_t", torch.int64) is torch.int64
    assert isinstance(nixl_ep.Buffer, type)


def test_vllm_sequence_on_one_rank(tmp_path):
    """vLLM's calls in its order on a world of one (capacity 2: the second rank never comes)."""
    store = dist.PrefixStore("nixl_ep", dist.FileStore(str(tmp_path / "s"), 1))
    num_rdma_bytes = Buffer.get_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=8, hidden=256, num_ranks=2, num_experts=8
    )
    buffer = Buffer(rank=0, tcp_store_group=store)
    buffer.update_memory_buffers(num_ranks=2, num_experts_per_rank=4, num_rdma_bytes=num_rdma_bytes)
    buffer.connect_ranks(list(range(1)))
    mask = torch.zeros(2, dtype=torch.int32)
    buffer.query_mask_buffer(mask)
    assert mask.tolist() == [0, 1]
    x, idx, w = procs.make_inputs(5, 0, 6, 8)
    expert_x, expert_num_tokens, handle, _, hook = buffer.dispatch(
        x, idx, 8, 8, use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
        return_recv_hook=True,
    )  # fmt: skip
    hook()
    assert tuple(expert_x[0].shape) == (4, 16, 256) and len(handle) == 4
    y = torch.zeros(4, 16, 256, dtype=torch.bfloat16)
    for i in range(4):
        n = int(expert_num_tokens[i])
        y[i, :n] = procs.expert(procs.dequant(expert_x, i, n, True), i)
    output = torch.empty(6, 256, dtype=torch.bfloat16)
    _, _, recv_hook = buffer.combine(
        y, idx, w, handle, async_finish=False, zero_copy=False, return_recv_hook=True, out=output
    )
    recv_hook()
    ref = procs.reference_combine(x, idx, w, True, lambda e: e < 4)
    assert torch.equal(output.view(torch.int16), ref.view(torch.int16))
    buffer.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
    buffer.clean_mask_buffer()
    buffer.set_tcp_store_group(None)
    # The same rank again: with the store gone the connected rank needs no store.
    buffer.connect_ranks([0])


# NIXL-EP's buffer.py (c5a9850f): parameter names, order and defaults of every public method.
NIXL_SIGNATURES = {
    "__init__": "(self, disable_ll_nvlink=False, explicitly_destroy=False, rank=0, "
    "low_latency_mode=True, group=None, comm=None, tcp_store_group=None, timeout_ms=30000)",
    "destroy": "(self)",
    "is_sm90_compiled": "()",
    "set_num_sms": "(new_num_sms)",
    "capture": "()",
    "get_low_latency_buffer_size_hint": "(num_max_dispatch_tokens_per_rank, hidden, num_ranks, "
    "num_experts)",
    "get_rdma_size_hint": "(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)",
    "get_comm_stream": "(self)",
    "get_local_buffer_tensor": "(self, dtype, size=None, offset=0, use_rdma_buffer=False)",
    "get_dispatch_config": "(num_ranks)",
    "get_combine_config": "(num_ranks)",
    "get_dispatch_layout": "(self, topk_idx, num_experts, previous_event=None, "
    "async_finish=False, allocate_on_comm_stream=False)",
    "low_latency_dispatch": "(self, x, topk_idx, num_max_dispatch_tokens_per_rank, "
    "num_experts=None, cumulative_local_expert_recv_stats=None, "
    "dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False, use_ue8m0=False, "
    "async_finish=False, return_recv_hook=False)",
    "low_latency_combine": "(self, x, topk_idx, topk_weights, handle, use_logfmt=False, "
    "zero_copy=False, async_finish=False, return_recv_hook=False, out=None, "
    "combine_wait_recv_cost_stats=None)",
    "ht_dispatch": "(self, x, handle=None, num_tokens_per_rank=None, "
    "num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None, "
    "topk_idx=None, topk_weights=None, expert_alignment=1, config=None, previous_event=None, "
    "async_finish=False, allocate_on_comm_stream=False)",
    "ht_combine": "(self, x, handle, topk_weights=None, bias=None, config=None, "
    "previous_event=None, async_finish=False, allocate_on_comm_stream=False)",
    "update_mask_buffer": "(self, rank_to_mask, mask=False)",
    "query_mask_buffer": "(self, mask_status)",
    "clean_mask_buffer": "(self)",
    "get_next_combine_buffer": "(self, handle)",
    "update_memory_buffers": "(self, num_ranks, num_experts_per_rank, num_rdma_bytes, "
    "num_nvl_bytes=0)",
    "set_tcp_store_group": "(self, tcp_store_group)",
    "connect_ranks": "(self, remote_ranks, activate=True)",
    "disconnect_ranks": "(self, remote_ranks)",
    "barrier": "(self)",
}


def _plain(fn) -> str:
    """A signature as names and defaults only; moecomm's keyword-only options dropped."""
    parts = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY:
            continue
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return "(" + ", ".join(parts) + ")"


@pytest.mark.parametrize("method", list(NIXL_SIGNATURES))
def test_nixl_signatures(method):
    assert _plain(getattr(Buffer, method)) == NIXL_SIGNATURES[method]


# NIXL-EP's nixl_ep/__init__.py (github.com/ai-dynamo/nixl examples/device/ep, commit
# 8770b655a, unchanged since f97f364e5): `__all__ = ["Buffer", "EventOverlap", "Config"]`, and
# `topk_idx_t` bound beside it. The rest of its namespace is its loader's (importlib, os, sys,
# contextmanager, torch, the compiled module, the buffer/utils submodules), not API.
NIXL_EP_ALL = {"Buffer", "EventOverlap", "Config"}
NIXL_EP_EXPORTS = NIXL_EP_ALL | {"topk_idx_t"}


def test_module_exports_exactly_nixl_eps_names():
    assert set(nixl_ep.__all__) == NIXL_EP_ALL and len(nixl_ep.__all__) == len(NIXL_EP_ALL)
    # Every attribute but the dunders: no helper, no imported module, no private name.
    assert {n for n in dir(nixl_ep) if not n.startswith("__")} == NIXL_EP_EXPORTS
    for name in NIXL_EP_ALL:
        assert isinstance(getattr(nixl_ep, name), type)


def test_aliases_and_exports():
    # NIXL-EP's dispatch/combine take *args, **kwargs and call the low-latency ones.
    assert _plain(Buffer.dispatch) == NIXL_SIGNATURES["low_latency_dispatch"]
    assert _plain(Buffer.combine) == NIXL_SIGNATURES["low_latency_combine"]
    assert nixl_ep.topk_idx_t is torch.int64 and nixl_ep_buffer.DEFAULT_TIMEOUT_MS == 30_000
    assert _plain(Config) == (
        "(num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256, "
        "num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256)"
    )
    assert _plain(EventOverlap) == "(event=None, extra_tensors=None)"


# ---------------------------------------------------------------------------- one process
def _one(tmp_path, capacity=2, **kw) -> Buffer:
    store = dist.FileStore(str(tmp_path / "s"), 1)
    b = Buffer(rank=0, tcp_store_group=store, explicitly_destroy=True, **kw)
    b.update_memory_buffers(num_ranks=capacity, num_experts_per_rank=4, num_rdma_bytes=0)
    return b


def test_refusals(tmp_path):
    with pytest.raises(NotImplementedError, match="low_latency_mode=False"):
        Buffer(low_latency_mode=False)
    with pytest.raises(ValueError, match="group or comm"):
        Buffer(group=object(), comm=object())
    b = _one(tmp_path)
    with pytest.raises(NotImplementedError, match="get_comm_stream"):
        b.get_comm_stream()
    with pytest.raises(NotImplementedError, match="ht_dispatch"):
        b.ht_dispatch(torch.zeros(1, 128))
    with pytest.raises(NotImplementedError, match="ht_combine"):
        b.ht_combine(torch.zeros(1, 128), None)
    with pytest.raises(NotImplementedError, match=r"get_local_buffer_tensor\(size"):
        b.get_local_buffer_tensor(torch.int8, torch.Size([16]))
    assert b.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).numel() == 0
    cuda_x = mock.Mock(spec=torch.Tensor)
    cuda_x.is_cuda = True
    with pytest.raises(NotImplementedError, match=r"dispatch on CUDA tensors \(x\)"):
        b.dispatch(cuda_x, torch.zeros(1, 2, dtype=torch.int64), 8)
    b.set_tcp_store_group(None)
    with pytest.raises(NotImplementedError, match="without a tcp_store_group"):
        b.connect_ranks([1])
    b.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        b.barrier()
    nd = Buffer(rank=0)
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        nd.destroy()
    with pytest.raises(RuntimeError, match="update_memory_buffers first"):
        nd.dispatch(torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(1, 2).long(), 8)


def test_masks_and_memory(tmp_path):
    b = _one(tmp_path, capacity=3)
    with pytest.raises(RuntimeError, match="Multiple calls"):
        b.update_memory_buffers(3, 4, 0)
    status = torch.zeros(3, dtype=torch.int32)
    b.query_mask_buffer(status)
    assert status.tolist() == [0, 1, 1] and b.group_size == 3
    with pytest.raises(ValueError, match="local rank"):
        b.update_mask_buffer(0, mask=True)
    with pytest.raises(ValueError, match="not connected"):
        b.update_mask_buffer(2, mask=False)
    b.update_mask_buffer(2, mask=True)  # masking an unconnected rank is allowed
    with pytest.raises(ValueError, match="num_ranks=3"):
        b.query_mask_buffer(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="int32"):
        b.query_mask_buffer(torch.zeros(3))
    with pytest.raises(ValueError, match="not connected"):
        b.disconnect_ranks([1])
    with pytest.raises(ValueError, match="this rank"):
        b.disconnect_ranks([0])
    with pytest.raises(RuntimeError, match="barrier before the first dispatch"):
        b.barrier()
    b.clean_mask_buffer()
    b.query_mask_buffer(status)
    assert status.tolist() == [0, 1, 1]
    # Rank bounds: num_experts=None is the active bound (rank 0 alone: 1 rank).
    x, idx, w = procs.make_inputs(3, 0, 5, 4)
    recv, _, handle, event, hook = b.dispatch(x, idx, 8, use_fp8=False, async_finish=True)
    event.current_stream_wait()
    assert tuple(recv.shape) == (4, 8, 256) and tuple(handle[1].shape) == (4, 1) and hook is None
    with pytest.raises(ValueError, match="multiple of num_experts_per_rank"):
        b.dispatch(x, idx, 8, 6, use_fp8=False)
    with pytest.raises(ValueError, match=r"\[4, 12\]"):
        b.dispatch(x, idx, 8, 16, use_fp8=False)
    big = idx.clone()
    big[0, 0] = 4  # beyond the rank bound of num_experts=None
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        b.dispatch(x, big, 8, use_fp8=False)
    with pytest.raises(ValueError, match="both be set"):
        b.dispatch(x, idx, 8, async_finish=True, return_recv_hook=True)
    y = torch.zeros(4, 8, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be bf16"):
        b.combine(y[:, :4], idx, w, handle)
    with pytest.raises(ValueError, match="handle must come"):
        b.combine(y, idx, w, tuple(handle))
    with pytest.raises(RuntimeError, match="no event"):
        b.combine(y, idx, w, handle)[1].current_stream_wait()
    b.barrier()  # alone: a round with itself
    # The top-k is per call (later calls up to the first one's).
    narrow = idx[:, :2].contiguous()
    recv, count, handle, _, _ = b.dispatch(x, narrow, 8, use_fp8=False)
    y = torch.zeros(4, 8, 256, dtype=torch.bfloat16)
    for i in range(4):
        n = int(count[i])
        y[i, :n] = procs.expert(recv[i, :n].float(), i)
    out, _, _ = b.combine(y, narrow, w[:, :2].contiguous(), handle)
    ref = procs.reference_combine(x, narrow, w[:, :2], False, lambda e: True)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    # A larger top-k than the first dispatch's fits: the slots were sized for up to SLOT_TOPK.
    wider = torch.cat([idx, torch.full_like(idx[:, :1], -1)], dim=1)
    recv, count, handle, _, _ = b.dispatch(x, wider, 8, use_fp8=False)
    y = torch.zeros(4, 8, 256, dtype=torch.bfloat16)
    for i in range(4):
        n = int(count[i])
        y[i, :n] = procs.expert(recv[i, :n].float(), i)
    w4 = torch.cat([w, torch.zeros_like(w[:, :1])], dim=1)
    out, _, _ = b.combine(y, wider, w4, handle)
    ref = procs.reference_combine(x, wider, w4, False, lambda e: True)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    widest = torch.cat([idx, torch.full((idx.shape[0], SLOT_TOPK), -1, dtype=idx.dtype)], dim=1)
    with pytest.raises(NotImplementedError, match=f"top-{widest.shape[1]}: the slots hold"):
        b.dispatch(x, widest, 8, use_fp8=False)
    b.destroy()


def test_rank_bound_below_capacity_and_replicas_keyword(tmp_path):
    """One rank of capacity 3 with replicas given by keyword: rank 0 hosts replicas of 5 and 9;
    num_experts 8 (bound 2) gives NIXL-EP's shapes [L + 2, 2*M, H], contiguous."""
    b = _one(tmp_path, capacity=3, replicas={5: [0], 9: [0, 1]})
    assert b.local_experts == [0, 1, 2, 3, 5, 9]
    b.connect_ranks([0])
    x, idx, w = procs.make_inputs(4, 0, 6, 8)
    procs.set_routes(b, {1, 2}, 3, {5: [0], 9: [0, 1]})
    for fp8 in (False, True):
        recv, count, handle, _, _ = b.dispatch(x, idx, 8, 8, use_fp8=fp8)
        y = procs.check_dispatch(b, {0: (x, idx, w)}, [0], 2, recv, count, handle, fp8,
                                 b.local_experts)  # fmt: skip
        assert int(count[4]) == int((idx == 5).sum()) > 0  # rank 1 masked: 5 served here
        out, _, _ = b.combine(y, idx, w, handle)
        ref = procs.reference_combine(x, idx, w, fp8, lambda e: e < 4 or e == 5)
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
        nxt = b.get_next_combine_buffer(handle)
        assert tuple(nxt.shape) == (6, 16, 256)
        nxt.copy_(y)
        out2, _, _ = b.combine(y, idx, w, handle, zero_copy=True)
        assert torch.equal(out2, out)
    assert b.dropped_copies == int(((idx >= 4) & (idx != 5)).sum()) * 2
    b.destroy()


def test_replicas_env(tmp_path, monkeypatch):
    monkeypatch.setenv(nixl_ep_buffer.REPLICAS_ENV, '{"5": [0]}')
    b = _one(tmp_path)
    assert b.local_experts == [0, 1, 2, 3, 5]
    b.destroy()
    monkeypatch.setenv(nixl_ep_buffer.REPLICAS_ENV, "[1, 2]")
    with pytest.raises(ValueError, match="MOECOMM_NIXL_EP_REPLICAS"):
        Buffer(rank=0)
    monkeypatch.setenv(nixl_ep_buffer.REPLICAS_ENV, '{"1": [0]}')  # expert 1's primary is rank 0
    (tmp_path / "again").mkdir()
    with pytest.raises(ValueError, match="primary"):
        _one(tmp_path / "again")


def test_get_dispatch_layout(tmp_path):
    b = _one(tmp_path, capacity=16)
    idx = torch.tensor([[0, 5, 63], [-1, 8, 9], [-1, -1, -1]])
    per_rank, per_rdma, per_expert, in_rank, event = b.get_dispatch_layout(idx, 64)
    want = torch.zeros(3, 16, dtype=torch.bool)
    want[0, [0, 1, 15]] = True
    want[1, 2] = True
    assert torch.equal(in_rank, want)
    assert per_rank.tolist() == want.sum(0).tolist() and per_rank.dtype == torch.int32
    assert per_rdma.tolist() == [2, 1]  # ranks 0-7 and 8-15 (capacity 16 > 8)
    assert per_expert.sum() == 5 and per_expert[63] == 1 and event.event is None
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        b.get_dispatch_layout(idx, 60)
    b.destroy()


def test_config_and_helpers():
    c = Buffer.get_dispatch_config(8)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (
        20, 6, 132,  # 128 aligned up to the send chunk (6), as NIXL-EP's Config does
    )  # fmt: skip
    assert Buffer.get_combine_config(2).num_max_nvl_chunked_send_tokens == 10
    with pytest.raises(ValueError, match="Unsupported"):
        Buffer.get_dispatch_config(3)
    assert Config(num_max_rdma_chunked_recv_tokens=250).num_max_rdma_chunked_recv_tokens == 252
    with pytest.raises(ValueError):
        Config(num_max_nvl_chunked_send_tokens=300)
    assert Config().get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert Config().get_rdma_buffer_size_hint(7168 * 2, 16) % 128 == 0
    assert Config().get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    assert Buffer.is_sm90_compiled() is False
    Buffer.set_num_sms(24)
    assert Buffer.num_sms == 24
    Buffer.set_num_sms(20)
    with pytest.raises(ValueError, match="even"):
        Buffer.set_num_sms(3)
    with Buffer.capture():
        pass
    Buffer.capture().current_stream_wait()
    hint = Buffer.get_low_latency_buffer_size_hint(128, 7168, 8, 256)
    assert hint == Buffer.get_rdma_size_hint(128, 7168, 8, 256) > 8 * 128 * 7168


# ---------------------------------------------------------------------------- handshake
def test_handshake_ignores_stale_keys():
    """Two ranks connect through one store holding the keys of an earlier, dead rank 1 (its
    hello to rank 0 and an ack to an earlier rank 0): each ends with the other's live hello, and
    the store is left clean."""
    store = dist.HashStore()
    prefix = "p"
    store.set(f"{prefix}/hello/1/0", '{"inc": "dead-1", "ctrl": "old"}')
    store.set(f"{prefix}/ack/1/0", "dead-1/dead-0")
    got: dict = {}

    def run(rank: int, peer: int, delay: float) -> None:
        time.sleep(delay)
        hello = {peer: {"inc": f"live-{rank}", "ctrl": f"c{rank}"}}
        got[rank] = handshake(store, prefix, rank, hello, 10.0)

    threads = [threading.Thread(target=run, args=(0, 1, 0.0)),
               threading.Thread(target=run, args=(1, 0, 0.2))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert got[0] == {1: {"inc": "live-1", "ctrl": "c1"}}
    assert got[1] == {0: {"inc": "live-0", "ctrl": "c0"}}
    for key in ("hello/0/1", "hello/1/0", "ack/1/0"):
        assert not store.check([f"{prefix}/{key}"]), key


def test_handshake_deadline():
    store = dist.HashStore()
    t0 = time.monotonic()
    with pytest.raises(moecomm.DeadlineExceededError, match=r"ranks \[1\] did not connect"):
        handshake(store, "p", 0, {1: {"inc": "a", "ctrl": "c"}}, 0.3)
    assert time.monotonic() - t0 < 5
    assert not store.check(["p/hello/0/1"])  # withdrawn


# ---------------------------------------------------------------------------- two ranks, threads
def _both(bufs, fn):
    """fn(buffer) on both Buffers at once (one thread each); re-raises the first failure."""
    errors: list = []

    def run(b):
        try:
            fn(b)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(b,)) for b in bufs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]


def test_silent_peer_masked_and_pair_reconnected():
    """Two ranks in one process (threads, an in-process store): a peer that stops calling is
    masked at the deadline, in the data path and at a pair's first round; disconnecting and
    connecting again re-synchronises the pair (fresh channels, the larger round counters)."""
    store = dist.HashStore()
    bufs = [
        Buffer(rank=r, tcp_store_group=store, explicitly_destroy=True, timeout_ms=400)
        for r in (0, 1)
    ]
    for b in bufs:
        b.update_memory_buffers(num_ranks=2, num_experts_per_rank=procs.L, num_rdma_bytes=0)
    _both(bufs, lambda b: b.connect_ranks([0, 1]))
    _both(bufs, lambda b: procs.round_trip(b, 90, [0, 1], 2, use_fp8=True))
    b0, b1 = bufs
    # Rank 1 stops calling: rank 0 masks it while waiting for its request, drops its copies.
    t0 = time.monotonic()
    procs.round_trip(b0, 91, [0, 1], 2, num_experts=8, senders=[0], answered=[0])
    assert procs.mask_of(b0, 2) == [0, 1] and time.monotonic() - t0 < 5
    assert "rank 1" in b0.runtime.engine.failures[-1]
    # Out of step now (rank 0 ran a round more): disconnect and connect again.
    b0.disconnect_ranks([1])
    b1.disconnect_ranks([0])
    assert procs.mask_of(b1, 2) == [1, 0]
    _both(bufs, lambda b: b.connect_ranks([0, 1]))
    # Rank 1 silent at the pair's first round: masked there, at the deadline.
    procs.round_trip(b0, 92, [0, 1], 2, num_experts=8, senders=[0], answered=[0])
    assert procs.mask_of(b0, 2) == [0, 1] and not b0.runtime.pairs[1].ready
    b0.disconnect_ranks([1])
    b1.disconnect_ranks([0])
    _both(bufs, lambda b: b.connect_ranks([0, 1]))
    _both(bufs, lambda b: procs.round_trip(b, 93, [0, 1], 2, hook=True))
    _both(bufs, lambda b: procs.round_trip(b, 94, [0, 1], 2, use_fp8=True, zero_copy=True))
    _both(bufs, lambda b: procs.two_in_flight(b, (95, 96), [0, 1], 2, use_fp8=False))
    assert b0.runtime.engine.counters() == b1.runtime.engine.counters()
    for b in bufs:
        b.destroy()


def test_clean_buffer_of_the_earlier_api_checks_its_arguments_and_keeps_serving(tmp_path):
    """SGLang 0.5.23 calls NIXL-EP's earlier clean_buffer(M, H, E): nothing to zero in moecomm,
    so it checks its arguments and the buffer goes on serving (a round with itself)."""
    b = _one(tmp_path)
    b.connect_ranks([0])
    b.clean_buffer(8, 256, 8)
    with pytest.raises(ValueError, match="hidden must be a positive int"):
        b.clean_buffer(8, 0, 8)
    x = torch.randn(4, 256).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0]])
    _, count, _, _, _ = b.dispatch(x, idx, 8, use_fp8=False)
    assert int(count.sum()) == 7
    b.destroy()


def test_the_runtime_drives_the_engine_through_its_public_surface():
    """runtime.py reads and sets the engine's mask, plan, local slots and set-up through the
    Engine's methods and properties, never through a private attribute of deep_ep.Buffer."""
    tree = ast.parse(inspect.getsource(nixl_ep_runtime))

    def is_engine(node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in ("eng", "engine")
        return isinstance(node, ast.Attribute) and node.attr == "engine"

    private = sorted(
        {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and n.attr.startswith("_")
            and not n.attr.startswith("__")
            and is_engine(n.value)
        }
    )
    assert private == []
