"""SGLang 0.5.23's DeepEP token dispatcher (sglang/srt/layers/moe/token_dispatcher/deepep.py),
driven in rank processes over moecomm's ``deep_ep`` (test_sglang_deepep.py checks outcomes).

How it is reached without a server: ``DeepEPDispatcher`` is built with the arguments SGLang's
MoE layer gives it (group = the gloo group, top-k, experts, hidden, bf16 params, a fixed
``DeepEPMode``), its wire dtype chosen through SGLang's own dispatcher config
(``set_quant_config({"dispatcher_output_dtype": ...})``), its token budget through SGLang's env
(``SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK``). SGLang builds the ``deep_ep.Buffer`` itself
(``DeepEPBuffer.get_deepep_buffer``) at the first dispatch; ``dispatch`` and ``combine`` run on
real tensors with a per-expert-scale expert between them.

CPU stand-ins, and why:
- ``torch.cuda.get_device_properties`` answers an SM count (132): ``get_deepep_buffer`` reads the
  device's SM count to decide whether to warn about DeepEP's SM share; CPU torch has no device.
- Normal mode runs with ``deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True``: SGLang's normal-mode
  ``combine_a`` raises ``NotImplementedError`` for any runner but DeepGEMM (or AITER / NPU), the
  Triton path being "temporarily disabled" there. With it, dispatch aligns experts to 128 rows,
  as with DeepGEMM; the wire stays bf16 (fp8 would call SGLang's CUDA quantization kernel).
"""

from __future__ import annotations

import json
import os
import types

import engine_env
import moe_reference as ref
import torch

H = 2048
M = 8
EXPERTS_PER_RANK = 8
SEED = 23
DEVICE = engine_env.DEVICE  # test_engines_gpu.py: "cuda"


# A tiny MoE checkpoint's config.json (no weights): what ServerArgs reads at construction.
TINY_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": H,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": EXPERTS_PER_RANK * 2,
    "num_experts_per_tok": 8,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "torch_dtype": "bfloat16",
}


def setup(ctx) -> None:
    """Publishes SGLang's ServerArgs (--moe-a2a-backend deepep) for a tiny local config, as
    the scheduler process does; the dispatcher reads it to choose its wire dtype."""
    os.environ["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(M)
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    model = os.path.join(ctx.workdir, f"tiny-moe-{ctx.rank}")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(TINY_MOE_CONFIG, f)
    args = ServerArgs(
        model_path=model, moe_a2a_backend="deepep", device=DEVICE, skip_tokenizer_init=True
    )
    publish(args, role="scheduler")
    if DEVICE == "cuda":
        return
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        multi_processor_count=132, name="CPU stand-in for the SM count"
    )


def _reset_buffer() -> None:
    """SGLang keeps one process-wide Buffer (and a DeepEP config singleton): each scenario
    starts without one, as a fresh server process would."""
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPConfig
    from sglang.srt.runtime_context import get_resources

    state = get_resources().buffers.pop("deepep_ep_state", None)
    if state is not None and state.buffer is not None:
        state.buffer.destroy()
    DeepEPConfig._instance = None


def _dispatcher(ctx, mode, topk: int, *, return_recv_hook=False, async_finish=False, dtype="bf16"):
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPDispatcher

    d = DeepEPDispatcher(
        group=ctx.group,
        router_topk=topk,
        permute_fusion=False,
        num_experts=EXPERTS_PER_RANK * ctx.num_ranks,
        num_local_experts=EXPERTS_PER_RANK,
        hidden_size=H,
        params_dtype=torch.bfloat16,
        deepep_mode=mode,
        async_finish=async_finish,
        return_recv_hook=return_recv_hook,
    )
    d.set_quant_config({"dispatcher_output_dtype": dtype})
    return d


def _sizes(ctx, seed: int) -> list[int]:
    sizes = [M - (seed + p) % 3 for p in range(ctx.num_ranks)]
    if ctx.num_ranks >= 3:
        sizes[2] = 0
    return sizes


def ll_round(ctx, d, seed: int, topk: int, use_fp8: bool) -> None:
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPLLCombineInput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    r, n, local = ctx.rank, ctx.num_ranks, EXPERTS_PER_RANK
    num_experts = local * n
    sizes = _sizes(ctx, seed)
    inputs = [ref.make_inputs(seed, p, sizes[p], num_experts, topk, H) for p in range(n)]
    x, idx, w = inputs[r]
    logits = torch.zeros(x.shape[0], num_experts, device=DEVICE)
    dx, didx, dw = x.to(DEVICE), idx.to(DEVICE), w.to(DEVICE)
    out = d.dispatch(dx, StandardTopKOutput(dw, didx, logits))
    assert out.format.is_deepep_ll(), out.format
    wire = ref.wire_rows(inputs, use_fp8)
    recv = out.hidden_states.cpu()
    scales = None if out.hidden_states_scale is None else out.hidden_states_scale.cpu()
    assert (scales is not None) == use_fp8
    y = torch.full((local, n * M, H), float("nan"), dtype=torch.bfloat16)
    for e in range(local):
        ge = r * local + e
        want = ref.routed(inputs, ge)
        got_m = int(out.masked_m[e])
        assert got_m == len(want), f"expert {ge}: masked_m {got_m}, expected {len(want)}"
        if not want:
            continue
        rows = torch.stack([wire[p][0][t] for p, t in want])
        got = recv[e, : len(want)]
        if use_fp8:
            assert torch.equal(got.view(torch.uint8), rows.view(torch.uint8)), f"e{ge} fp8 rows"
            want_scales = torch.stack([wire[p][1][t] for p, t in want])
            assert torch.equal(scales[e, : len(want)], want_scales), f"expert {ge}: scales"
        else:
            assert torch.equal(got.view(torch.int16), rows.view(torch.int16)), f"e{ge} rows"
        seen = torch.stack([wire[p][2][t] for p, t in want])
        y[e, : len(want)] = ref.expert(seen, ge)
    combined = d.combine(DeepEPLLCombineInput(y.to(DEVICE), out.topk_ids, out.topk_weights))
    assert torch.equal(combined.cpu(), ref.ll_combine(wire[r][2], idx, w)), f"combine (top-{topk})"


def ll(topk: int, return_recv_hook: bool):
    def scenario(ctx) -> None:
        from sglang.srt.layers.moe.utils import DeepEPMode

        _reset_buffer()
        try:
            for i, dtype in enumerate(["bf16", "fp8", "bf16"]):
                d = _dispatcher(
                    ctx,
                    DeepEPMode.LOW_LATENCY,
                    topk,
                    return_recv_hook=return_recv_hook,
                    dtype=dtype,
                )
                assert d._low_latency_dispatcher.use_fp8 == (dtype == "fp8")
                ll_round(ctx, d, SEED + 10 * topk + i, topk, dtype == "fp8")
        finally:
            _reset_buffer()

    return scenario


def normal(topk: int, async_finish: bool):
    def scenario(ctx) -> None:
        from sglang.srt.layers import deep_gemm_wrapper
        from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPNormalCombineInput
        from sglang.srt.layers.moe.topk import StandardTopKOutput
        from sglang.srt.layers.moe.utils import DeepEPMode

        r, n, local = ctx.rank, ctx.num_ranks, EXPERTS_PER_RANK
        num_experts = local * n
        mine = range(r * local, (r + 1) * local)
        _reset_buffer()
        before = deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM
        deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True
        try:
            d = _dispatcher(ctx, DeepEPMode.NORMAL, topk, async_finish=async_finish)
            for seed in (SEED + 100 + topk, SEED + 200 + topk):
                sizes = _sizes(ctx, seed)
                inputs = [
                    ref.make_inputs(seed, p, sizes[p], num_experts, topk, H) for p in range(n)
                ]
                x, idx, w = inputs[r]
                out = d.dispatch(x, StandardTopKOutput(w, idx, torch.zeros(x.shape[0], 1)))
                assert out.format.is_deepep_normal(), out.format
                want = [
                    (p, t)
                    for p in range(n)
                    for t in range(sizes[p])
                    if any(int(e) in mine for e in inputs[p][1][t])
                ]
                recv = out.hidden_states
                assert recv.shape == (len(want), H), tuple(recv.shape)
                rows = torch.stack([inputs[p][0][t] for p, t in want]) if want else recv[:0]
                assert torch.equal(recv.view(torch.int16), rows.view(torch.int16)), "rows"
                y = torch.empty(len(want), H, dtype=torch.bfloat16)
                for i, (p, t) in enumerate(want):
                    src_idx, src_w = inputs[p][1][t], inputs[p][2][t]
                    ids = [int(e) - r * local if int(e) in mine else -1 for e in src_idx]
                    pairs = zip(src_idx, src_w, strict=True)
                    wts = [float(v) if int(e) in mine else 0.0 for e, v in pairs]
                    assert out.topk_ids[i].tolist() == ids, f"row {i}: {out.topk_ids[i].tolist()}"
                    assert out.topk_weights[i].tolist() == wts, f"row {i}: weights"
                    y[i] = ref.reduced_row(recv[i].float(), src_idx, src_w, mine)
                aligned = []
                for e in range(local):
                    c = sum(1 for p, t in want if r * local + e in inputs[p][1][t].tolist())
                    aligned.append((c + 127) // 128 * 128)
                assert list(out.num_recv_tokens_per_expert) == aligned
                combined = d.combine(DeepEPNormalCombineInput(y, out.topk_ids, out.topk_weights))
                assert torch.equal(combined, ref.normal_combine(x, idx, w, n, local)), "combine"
        finally:
            deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = before
            _reset_buffer()

    return scenario


SCENARIOS = {
    "ll_top8_hook": ll(8, True),
    "ll_top2_no_hook": ll(2, False),
    "ll_top5_hook": ll(5, True),
    "normal_top8": normal(8, False),
    "normal_top4_async": normal(4, True),
}
