"""vLLM 0.33.0's DeepEP prepare/finalize classes, driven in rank processes over moecomm's
``deep_ep`` (rank_group.py runs them; test_vllm_deepep.py checks the outcomes).

How the engine's classes are reached without an engine: ``setup`` builds vLLM's own parallel
state on the gloo group (``init_distributed_environment`` + ``initialize_model_parallel`` under
``set_current_vllm_config(VllmConfig(parallel_config=ParallelConfig(data_parallel_size=R,
enable_expert_parallel=True, distributed_executor_backend="external_launcher"),
device_config=DeviceConfig(device="cpu")))``), so the EP group is vLLM's. Buffers come from
vLLM's all2all managers (``DeepEPLLAll2AllManager`` / ``DeepEPHTAll2AllManager`` on the EP group's
``cpu_group``: ``get_handle`` builds ``deep_ep.Buffer`` with vLLM's own kwargs), and the
prepare/finalize objects are built with the arguments ``all2all_utils.maybe_make_prepare_finalize``
gives them. Their ``prepare``/``prepare_async`` and ``finalize``/``finalize_async`` run on real
tensors; the expert between them is a per-expert scale (moe_reference.expert).

Left to CPU stand-ins, and why: the experts' reduction for the normal-mode classes is
``TopKWeightAndReduceNoOP`` (the expert output comes reduced), because vLLM's
``TopKWeightAndReduceContiguous`` calls ``vllm._C``'s ``moe_sum``, a compiled op the CPU
environment does not have (the CUDA wheel's ``_C`` does not load without CUDA).
"""

from __future__ import annotations

import os
import types

import engine_env
import moe_reference as ref
import torch

H = 2048  # DeepEP LL's smallest supported hidden size (DeepEPLLPrepareAndFinalize)
M = 8  # max tokens per rank
EXPERTS_PER_RANK = 8
SEED = 11
# Where the drives put their tensors: "cpu" here; test_engines_gpu.py sets "cuda".
DEVICE = engine_env.DEVICE


def setup(ctx) -> None:
    if DEVICE == "cpu":
        # vLLM's CPU platform: its CUDA build finds no platform otherwise (and then asks for
        # pinned memory). Read when vllm.platforms is first imported, which is below.
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    parallel = ParallelConfig(
        data_parallel_size=ctx.num_ranks,
        enable_expert_parallel=True,
        distributed_executor_backend="external_launcher",
    )
    config = VllmConfig(parallel_config=parallel, device_config=DeviceConfig(device=DEVICE))
    scope = set_current_vllm_config(config)
    scope.__enter__()  # for the life of the process: the managers read it
    ctx.state["config_scope"] = scope
    store = os.path.join(ctx.workdir, "store")
    parallel_state.init_distributed_environment(
        ctx.num_ranks, ctx.rank, f"file://{store}", 0, backend="gloo"
    )
    parallel_state.initialize_model_parallel(1, 1)
    ep = parallel_state.get_ep_group()
    assert ep.world_size == ctx.num_ranks, f"vLLM's EP group has {ep.world_size} ranks"
    ctx.state["ep_group"] = ep.cpu_group


def teardown(ctx) -> None:
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()


# ------------------------------------------------------------------------ low-latency (LL)
def _ll_manager(ctx):
    from vllm.distributed.device_communicators.all2all import DeepEPLLAll2AllManager

    return DeepEPLLAll2AllManager(ctx.state["ep_group"])


def _ll_handle(ctx, manager, num_experts: int):
    return manager.get_handle(
        dict(
            max_num_tokens_per_dp_rank=M,
            token_hidden_size=H,
            num_ep_ranks=ctx.num_ranks,
            num_global_experts=num_experts,
            num_local_experts=num_experts // ctx.num_ranks,
        )
    )


def _quant_config(block_fp8: bool):
    from vllm.model_executor.layers.fused_moe.config import (
        FUSED_MOE_UNQUANTIZED_CONFIG,
        FusedMoEQuantConfig,
    )

    if not block_fp8:
        return FUSED_MOE_UNQUANTIZED_CONFIG
    return FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])


def _sizes(ctx, seed: int) -> list[int]:
    """Tokens per rank: full, ragged, and one rank with none when there are 3 or more."""
    sizes = [M - (seed + p) % 4 for p in range(ctx.num_ranks)]
    sizes[0] = M
    if ctx.num_ranks >= 3:
        sizes[2] = 0
    return sizes


def ll_round(ctx, pf, seed: int, topk: int, mode: str, do_async: bool) -> None:
    """One prepare + expert + finalize through vLLM's DeepEPLLPrepareAndFinalize, checked
    against the reference. mode: "bf16" (bf16 dispatch), "fp8" (fp8 dispatch, block-fp8
    experts: vLLM hands DeepEP's fp8 rows and scales through), "fp8-dequant" (fp8 dispatch,
    unquantized experts: vLLM dequantizes the rows back to bf16)."""
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
    )

    r, n = ctx.rank, ctx.num_ranks
    local = EXPERTS_PER_RANK
    num_experts = local * n
    sizes = _sizes(ctx, seed)
    inputs = [ref.make_inputs(seed, p, sizes[p], num_experts, topk, H) for p in range(n)]
    x, idx, w = inputs[r]
    use_fp8 = mode != "bf16"
    assert pf.use_fp8_dispatch == use_fp8
    qc = _quant_config(mode == "fp8")
    dx, didx, dw = x.to(DEVICE), idx.to(DEVICE), w.to(DEVICE)
    if do_async:
        hook, receiver = pf.prepare_async(dx, dw, didx, num_experts, None, False, qc)
        hook()
        expert_x, expert_scale, meta, _, _ = receiver()
    else:
        expert_x, expert_scale, meta, _, _ = pf.prepare(dx, dw, didx, num_experts, None, False, qc)
    expert_x = expert_x.cpu()
    expert_scale = None if expert_scale is None else expert_scale.cpu()
    wire = ref.wire_rows(inputs, use_fp8)
    counts = meta.expert_num_tokens.cpu()
    y = torch.full((local, n * M, H), float("nan"), dtype=torch.bfloat16)
    for e in range(local):
        ge = r * local + e
        want = ref.routed(inputs, ge)
        got = int(counts[e])
        assert got == len(want), f"expert {ge}: {got} rows, expected {len(want)}"
        if not want:
            continue
        rows = torch.stack([wire[p][0][t] for p, t in want])
        if mode == "fp8":
            assert expert_x.dtype == torch.float8_e4m3fn, expert_x.dtype
            assert torch.equal(expert_x[e, : len(want)].view(torch.uint8), rows.view(torch.uint8))
            scales = torch.stack([wire[p][1][t] for p, t in want])
            assert torch.equal(expert_scale[e, : len(want)], scales), f"expert {ge}: scales"
            seen = torch.stack([wire[p][2][t] for p, t in want])
        elif mode == "fp8-dequant":
            assert expert_x.dtype == torch.bfloat16 and expert_scale is None
            deq = torch.stack([wire[p][2][t] for p, t in want]).to(torch.bfloat16)
            assert torch.equal(expert_x[e, : len(want)], deq), f"expert {ge}: dequantized rows"
            seen = deq.float()
        else:
            assert expert_x.dtype == torch.bfloat16 and expert_scale is None
            assert torch.equal(expert_x[e, : len(want)].view(torch.int16), rows.view(torch.int16))
            seen = rows.float()
        y[e, : len(want)] = ref.expert(seen, ge)
    out = torch.empty(x.shape[0], H, dtype=torch.bfloat16, device=DEVICE)
    delegate = TopKWeightAndReduceDelegate()
    if do_async:
        recv_hook, post = pf.finalize_async(out, y.to(DEVICE), dw, didx, False, delegate)
        assert recv_hook is not None
        recv_hook()
        post()
    else:
        pf.finalize(out, y.to(DEVICE), dw, didx, False, delegate)
    out = out.cpu()
    seen_x = {"bf16": x.float(), "fp8": wire[r][2], "fp8-dequant": wire[r][2].bfloat16().float()}
    want_out = ref.ll_combine(seen_x[mode], idx, w)
    assert torch.equal(out, want_out), f"combine differs from the reference ({mode}, top-{topk})"


def _ll_pf(ctx, handle, use_fp8: bool):
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import (
        DeepEPLLPrepareAndFinalize,
    )

    return DeepEPLLPrepareAndFinalize(
        handle, max_tokens_per_rank=M, num_dispatchers=ctx.num_ranks, use_fp8_dispatch=use_fp8
    )


def ll_topk(topk: int):
    """bf16 and fp8 dispatch (both fp8 modes), sync and async, at one top-k, on one buffer."""

    def scenario(ctx) -> None:
        manager = _ll_manager(ctx)
        try:
            handle = _ll_handle(ctx, manager, EXPERTS_PER_RANK * ctx.num_ranks)
            seed = SEED + topk
            for mode, do_async in [
                ("bf16", False),
                ("bf16", True),
                ("fp8", False),
                ("fp8", True),
                ("fp8-dequant", False),
            ]:
                pf = _ll_pf(ctx, handle, mode != "bf16")
                ll_round(ctx, pf, seed, topk, mode, do_async)
                seed += 1
        finally:
            manager.destroy()

    return scenario


def ll_topk_mixed_one_buffer(ctx) -> None:
    """The contract: vLLM's manager caches one Buffer per shape (top-k is not part of its key),
    so layers with different top-k share it: top-k 2, 5, 8, then 2 again, on one buffer."""
    manager = _ll_manager(ctx)
    try:
        handle = _ll_handle(ctx, manager, EXPERTS_PER_RANK * ctx.num_ranks)
        for i, topk in enumerate([2, 5, 8, 2]):
            assert _ll_handle(ctx, manager, EXPERTS_PER_RANK * ctx.num_ranks) is handle
            ll_round(ctx, _ll_pf(ctx, handle, False), 40 + i, topk, "bf16", i % 2 == 1)
    finally:
        manager.destroy()


# ------------------------------------------------------------------- high-throughput (HT)
def _exact_inputs(seed: int, rank: int, tokens: int, num_experts: int, topk: int):
    """Inputs whose every product and partial sum is exact in bf16 (x in {-2..2}/2, weights in
    {0.5, 1}, expert scales 1 + e/8 on few experts): the reduction order cannot change a bit,
    for the engines whose combine order moecomm documents but this test does not model."""
    x, idx, _ = ref.make_inputs(seed, rank, tokens, num_experts, topk, H)
    g = torch.Generator().manual_seed(seed * 31 + rank)
    x = (torch.randint(-2, 3, (tokens, H), generator=g).float() / 2).to(torch.bfloat16)
    w = torch.randint(1, 3, (tokens, topk), generator=g).float() / 2
    return x, idx, w


def _exact_expert(rows_f32: torch.Tensor, global_expert: int) -> torch.Tensor:
    return (rows_f32 * float(1 + global_expert % 2)).to(torch.bfloat16)


def _exact_combine(inputs, r: int) -> torch.Tensor:
    x, idx, w = inputs[r]
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                out[t] += float(w[t, k]) * _exact_expert(x[t].float(), e).double()
    return out


def ht_round(ctx, pf, seed: int, topk: int, do_async: bool) -> None:
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceNoOP,
    )

    r, n = ctx.rank, ctx.num_ranks
    local = EXPERTS_PER_RANK
    num_experts = local * n
    sizes = _sizes(ctx, seed)
    inputs = [_exact_inputs(seed, p, sizes[p], num_experts, topk) for p in range(n)]
    x, idx, w = inputs[r]
    qc = FUSED_MOE_UNQUANTIZED_CONFIG
    if do_async:
        expert_x, scale, meta, recv_ids, recv_w = pf.prepare_async(
            x, w, idx, num_experts, None, False, qc
        )()
    else:
        expert_x, scale, meta, recv_ids, recv_w = pf.prepare(
            x, w, idx, num_experts, None, False, qc
        )
    mine = range(r * local, (r + 1) * local)
    want = [
        (p, t)
        for p in range(n)
        for t in range(sizes[p])
        if any(int(e) in mine for e in inputs[p][1][t])
    ]
    assert scale is None and expert_x.shape == (len(want), H), tuple(expert_x.shape)
    rows = torch.stack([inputs[p][0][t] for p, t in want]) if want else expert_x[:0]
    assert torch.equal(expert_x.view(torch.int16), rows.view(torch.int16)), "received rows"
    filler = num_experts - 1 if r == 0 else 0  # vLLM's stand-in for a -1 (another rank's)
    y = torch.empty(len(want), H, dtype=torch.bfloat16)
    for i, (p, t) in enumerate(want):
        src_idx, src_w = inputs[p][1][t], inputs[p][2][t]
        want_ids = [int(e) if int(e) in mine else filler for e in src_idx]
        want_w = [float(v) if int(e) in mine else 0.0 for e, v in zip(src_idx, src_w, strict=True)]
        assert recv_ids[i].tolist() == want_ids, f"row {i}: topk ids {recv_ids[i].tolist()}"
        assert recv_w[i].tolist() == want_w, f"row {i}: topk weights"
        acc = torch.zeros(H)
        for e, v in zip(recv_ids[i].tolist(), recv_w[i].tolist(), strict=True):
            if e in mine:
                acc += v * _exact_expert(expert_x[i].float(), e).float()
        y[i] = acc.to(torch.bfloat16)
    counts = meta.expert_num_tokens_cpu.tolist()
    for e in range(local):
        got = sum(1 for p, t in want if r * local + e in inputs[p][1][t].tolist())
        assert counts[e] == got, f"expert {r * local + e}: {counts[e]} tokens, expected {got}"
    out = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
    noop = TopKWeightAndReduceNoOP()
    if do_async:
        pf.finalize_async(out, y, recv_w, recv_ids, False, noop)()
    else:
        pf.finalize(out, y, recv_w, recv_ids, False, noop)
    want_out = _exact_combine(inputs, r)
    assert torch.equal(out.double(), want_out), "combine differs from the exact reference"


def ht(topk: int):
    def scenario(ctx) -> None:
        from vllm.distributed.device_communicators.all2all import DeepEPHTAll2AllManager
        from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht import (
            DeepEPHTPrepareAndFinalize,
        )

        manager = DeepEPHTAll2AllManager(ctx.state["ep_group"])
        try:
            handle = manager.get_handle({})
            pf = DeepEPHTPrepareAndFinalize(
                handle,
                num_dispatchers=ctx.num_ranks,
                dp_size=ctx.num_ranks,
                rank_expert_offset=ctx.rank * EXPERTS_PER_RANK,
            )
            ht_round(ctx, pf, SEED + 100 + topk, topk, do_async=False)
            ht_round(ctx, pf, SEED + 200 + topk, topk, do_async=True)
        finally:
            manager.destroy()

    return scenario


# ------------------------------------------------------------------ DeepEP v2 (ElasticBuffer)
def v2_prefill(ctx) -> None:
    """vLLM's DeepEPV2PrepareAndFinalize in prefill mode (use_cudagraph=False: do_expand,
    do_cpu_sync), on an ElasticBuffer built with DeepEPV2All2AllManager's own kwargs. The
    manager itself does not run on CPU (test_vllm_deepep.V2_MANAGER_ON_CPU says why)."""
    import deep_ep
    from vllm.distributed.device_communicators.all2all import DeepEPV2All2AllManager
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_v2 import (
        DeepEPV2PrepareAndFinalize,
    )
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceNoOP,
    )

    r, n, topk = ctx.rank, ctx.num_ranks, 4
    local = EXPERTS_PER_RANK
    num_experts = local * n
    manager_like = types.SimpleNamespace(_device_group=None, cpu_group=ctx.state["ep_group"])
    kwargs = DeepEPV2All2AllManager._make_all2all_kwargs(
        manager_like, num_max_tokens_per_rank=M, hidden=H, num_topk=topk, use_fp8_dispatch=False
    )
    buf = deep_ep.ElasticBuffer(**kwargs)
    try:
        pf = DeepEPV2PrepareAndFinalize(
            buf,
            num_dispatchers=n,
            dp_size=n,
            rank_expert_offset=r * local,
            num_experts=num_experts,
            num_topk=topk,
            use_fp8_dispatch=False,
            use_cudagraph=False,
        )
        for seed, do_async in [(SEED + 300, False), (SEED + 301, True)]:
            sizes = _sizes(ctx, seed)
            inputs = [_exact_inputs(seed, p, sizes[p], num_experts, topk) for p in range(n)]
            x, idx, w = inputs[r]
            qc = FUSED_MOE_UNQUANTIZED_CONFIG
            expert_x, scale, meta, recv_ids, recv_w = pf.prepare(
                x, w, idx, num_experts, None, False, qc
            )
            assert scale is None and recv_ids.shape[1] == 1, tuple(recv_ids.shape)
            # expanded layout: one row per (token, local expert), grouped by expert
            counts = meta.expert_num_tokens_cpu.tolist()
            rows_of = {}
            start = 0
            for e in range(local):
                ge = r * local + e
                want = ref.routed(inputs, ge)
                assert counts[e] >= len(want), f"expert {ge}: {counts[e]} < {len(want)}"
                got = expert_x[start : start + len(want)]
                rows = torch.stack([inputs[p][0][t] for p, t in want]) if want else got[:0]
                assert torch.equal(got.view(torch.int16), rows.view(torch.int16)), f"e{ge} rows"
                assert bool((recv_ids[start : start + counts[e], 0] == ge).all())
                rows_of[ge] = (start, want)
                start += counts[e]
            y = torch.zeros(expert_x.shape[0], H, dtype=torch.bfloat16)
            for ge, (s, want) in rows_of.items():
                for i, (p, t) in enumerate(want):
                    k = inputs[p][1][t].tolist().index(ge)
                    wt = float(inputs[p][2][t][k])
                    assert float(recv_w[s + i, 0]) == wt, f"expert {ge} row {i}: weight"
                    y[s + i] = (wt * _exact_expert(expert_x[s + i].float(), ge).float()).bfloat16()
            out = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
            noop = TopKWeightAndReduceNoOP()
            if do_async:
                pf.finalize_async(out, y, recv_w, recv_ids, False, noop)()
            else:
                pf.finalize(out, y, recv_w, recv_ids, False, noop)
            assert torch.equal(out.double(), _exact_combine(inputs, r)), "v2 combine"
    finally:
        buf.destroy()


SCENARIOS = {
    "ll_top2": ll_topk(2),
    "ll_top5": ll_topk(5),
    "ll_top8": ll_topk(8),
    "ll_topk_2_5_8_one_buffer": ll_topk_mixed_one_buffer,
    "ht_top4": ht(4),
    "ht_top8": ht(8),
    "v2_prefill": v2_prefill,
}
