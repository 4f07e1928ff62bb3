"""Rank processes for test_deep_ep_ll_contract.py: DeepEP's own low-latency test
(``tests/legacy/test_low_latency.py`` of deepseek-ai/DeepEP, dd758ca) walked on CPU tensors, its
assertions kept, plus an independent plain-torch reference of what each call must return.

Reference (DeepEP's documented semantics; the order inside an expert is moecomm's deterministic
one: source rank major, token ascending): local expert ``i`` of rank ``r`` receives every
(rank p, token t) of a live rank p whose ``topk_idx[p][t]`` holds ``r*L + i``; bf16 rows as
sent, fp8 rows as DeepEP's cast (``deep_ep_procs.deepep_fp8``), scales f32 or UE8M0 exponent
bytes packed four to an int32. Combine: ``out[t] = Σ_k w[t, k] · y(t, k)`` in f32, k ascending,
skipping -1 and experts of masked ranks.

Every rank regenerates every rank's inputs from the seed (DeepEP all-gathers topk_idx instead).
"""

from __future__ import annotations

import random
import time
import traceback

import torch
from deep_ep_procs import deepep_fp8

SHRINK_TIMEOUT_S = 4.0
TIMEOUT_S = 30.0

# name -> (hidden, num_experts, num_tokens, num_topk, use_logfmt, shrink)
CONFIGS = {
    "main_h2048": (2048, 32, 8, 8, False, False),
    "logfmt_h4096": (4096, 64, 5, 8, True, False),
    "ragged_h7168": (7168, 32, 6, 8, False, False),
    "shrink_h7168_e288": (7168, 288, 3, 8, False, True),
}


# ---------------------------------------------------------------------------- DeepEP's helpers
def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    sim = 2 * (x * y).sum() / denominator
    return (1 - sim).item()


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """deep_ep.utils.math.per_token_cast_back, without torch.compile."""
    if x_fp8.numel() == 0:
        return x_fp8.to(torch.bfloat16)
    m, n = x_fp8.shape
    if x_scales.dtype == torch.int:
        x_scales = x_scales.view(dtype=torch.uint8).to(torch.int) << 23
        x_scales = x_scales.view(dtype=torch.float)
    x_fp32 = x_fp8.to(torch.float32).view(m, -1, 128)
    x_scales = x_scales.view(m, -1, 1)
    return (x_fp32 * x_scales).view(m, n).to(torch.bfloat16)


# ---------------------------------------------------------------------------- inputs
def rank_inputs(seed, rank, num_tokens, hidden, num_experts, num_topk, use_logfmt):
    """DeepEP's test_main inputs of one rank, from generators of its own (seed + rank)."""
    g = torch.Generator().manual_seed(seed + rank)
    rnd = random.Random(seed + rank)
    rank_offset = 128
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * (rank - rank_offset)
    x[:, -128:] = torch.arange(num_tokens).to(torch.bfloat16).view(-1, 1)
    x_list = [x]
    for _ in range(4 if use_logfmt else 0):
        r = rnd.random()
        x_list.append((torch.randn((num_tokens, hidden), generator=g) * 0.5 * r).to(torch.bfloat16))
    x_list.append((torch.randn((num_tokens, hidden), generator=g) * 0.1).to(torch.bfloat16))
    scores = torch.randn((num_tokens, num_experts), generator=g).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=True)[1]
    topk_weights = torch.randn((num_tokens, num_topk), generator=g).abs()
    for _ in range(10 if num_tokens else 0):
        topk_idx[rnd.randint(0, num_tokens - 1), rnd.randint(0, num_topk - 1)] = -1
    return x_list, topk_idx, topk_weights


# ---------------------------------------------------------------------------- reference checks
def ue8m0_pack_reference(inv: torch.Tensor) -> torch.Tensor:
    """[n, S] power-of-two f32 -> [n, S/4] int32: byte j of word i = biased exponent of 4i+j."""
    mant, ex = torch.frexp(inv)
    assert bool((mant == 0.5).all()), "round_scale scales must be powers of two"
    byte = (ex - 1 + 127).to(torch.int64)
    n, s = inv.shape
    b = byte.view(n, s // 4, 4)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def expected_rows(rank, num_ranks, num_local, all_idx, live):
    """Per local expert: the (source rank, token) pairs it must hold, in order."""
    out = []
    for i in range(num_local):
        e = rank * num_local + i
        out.append(
            [
                (p, t)
                for p in range(num_ranks)
                if live[p]
                for t in range(all_idx[p].shape[0])
                if e in all_idx[p][t].tolist()
            ]
        )
    return out


def check_dispatch_reference(ctx, recv, count, handle, cur_xs, fp8, round_scale, ue8m0, live):
    """recv_x, recv_count, src_info and layout_range against the reference, bit for bit."""
    r, nr, num_local, all_idx = ctx["rank"], ctx["num_ranks"], ctx["num_local"], ctx["all_idx"]
    want = expected_rows(r, nr, num_local, all_idx, live)
    src_info, layout_range = handle[0], handle[1]
    casts = [deepep_fp8(x, round_scale) if fp8 else None for x in cur_xs]
    for i, rows in enumerate(want):
        n = len(rows)
        assert int(count[i]) == n, f"expert {i}: count {int(count[i])} != {n}"
        assert src_info[i, :n].tolist() == [t for _, t in rows], f"src_info of expert {i}"
        begin = 0
        for p in range(nr):
            c = sum(1 for q, _ in rows if q == p)
            assert int(layout_range[i, p]) == (begin << 32) | c, f"layout_range[{i}, {p}]"
            begin += c
        if not n:
            continue
        if not fp8:
            ref = torch.stack([cur_xs[p][t] for p, t in rows])
            assert torch.equal(recv[i, :n].view(torch.int16), ref.view(torch.int16))
            continue
        q = torch.stack([casts[p][0][t] for p, t in rows])
        inv = torch.stack([casts[p][1][t] for p, t in rows])
        assert torch.equal(recv[0][i, :n].view(torch.uint8), q.view(torch.uint8)), "fp8 bytes"
        sc = recv[1]
        assert sc.stride(1) == 1, "scales must be column-major in the last two dims"
        if ue8m0:
            assert sc.dtype == torch.int32 and sc.shape[2] == cur_xs[0].shape[1] // 512
            assert torch.equal(sc[i, :n], ue8m0_pack_reference(inv)), "UE8M0 scales"
        else:
            assert sc.dtype == torch.float32 and torch.equal(sc[i, :n], inv), "f32 scales"


def combine_reference(x, idx, w, skip):
    """Σ_k w[t, k] · y(t, k) in f32, k ascending (y: the bf16 rows DeepEP's test combines)."""
    acc = torch.zeros(x.shape, dtype=torch.float32)
    y = x.float()
    for k in range(idx.shape[1]):
        valid = (idx[:, k] >= 0) & ~skip[:, k]
        prod = w[:, k : k + 1] * y
        acc = torch.where(valid[:, None], acc + prod, acc)
    return acc.to(torch.bfloat16)


# ---------------------------------------------------------------------------- DeepEP's test_main
def simulate_failure_and_skip(rank, api, expected_masked_ranks):
    failed_api_ranks = {"dispatch": 1, "combine": 3, "clean": 5}
    if rank in expected_masked_ranks:
        return True
    if api in failed_api_ranks:
        expected_masked_ranks.add(failed_api_ranks[api])
        if failed_api_ranks[api] == rank:
            return True
    return False


def query_mask_buffer_and_check(buffer, mask_status, expected_masked_ranks):
    buffer.low_latency_query_mask_buffer(mask_status)
    assert set(mask_status.nonzero().squeeze(-1).tolist()) == expected_masked_ranks


def test_main(buffer, cfg, seed=1):
    """DeepEP's test_main (correctness part), its assertions kept, the reference checks added."""
    import moecomm.compat.deep_ep as deep_ep

    hidden, num_experts, num_tokens, num_topk, use_logfmt, shrink_test = cfg
    rank, num_ranks = buffer.rank, buffer.num_ranks
    num_local_experts = num_experts // num_ranks
    rank_offset = 128
    inputs = [
        rank_inputs(seed, p, num_tokens, hidden, num_experts, num_topk, use_logfmt)
        for p in range(num_ranks)
    ]
    x_list, topk_idx, topk_weights = inputs[rank]
    topk_idx = topk_idx.to(deep_ep.topk_idx_t)
    x = x_list[0]
    all_topk_idx = torch.stack([inp[1] for inp in inputs])
    ctx = {
        "rank": rank,
        "num_ranks": num_ranks,
        "num_local": num_local_experts,
        "all_idx": [all_topk_idx[p] for p in range(num_ranks)],
    }
    mask_status = torch.zeros((num_ranks,), dtype=torch.int)
    expected_masked_ranks: set = set()
    num_times = 0
    checked = {"dispatch": 0, "combine": 0}
    for xi, current_x in enumerate(x_list):
        cur_xs = [inp[0][xi] for inp in inputs]
        for return_recv_hook in (False, True):
            for dispatch_use_fp8 in (False, True):
                for round_scale in (False, True) if dispatch_use_fp8 else (False,):
                    for use_ue8m0 in (False, True) if round_scale else (False,):
                        if shrink_test and simulate_failure_and_skip(
                            rank, "dispatch", expected_masked_ranks
                        ):
                            break
                        num_times += 1
                        for _ in range((num_times % 2) + 1):  # once or twice: uncombined ones
                            stats = torch.zeros((num_local_experts,), dtype=torch.int)
                            cost = torch.zeros((num_ranks,), dtype=torch.int64)
                            packed_recv_x, packed_recv_count, handle, event, hook = (
                                buffer.low_latency_dispatch(
                                    current_x,
                                    topk_idx,
                                    num_tokens,
                                    num_experts,
                                    use_fp8=dispatch_use_fp8,
                                    round_scale=round_scale,
                                    use_ue8m0=use_ue8m0,
                                    cumulative_local_expert_recv_stats=stats,
                                    dispatch_wait_recv_cost_stats=cost,
                                    async_finish=not return_recv_hook,
                                    return_recv_hook=return_recv_hook,
                                )
                            )
                            hook() if return_recv_hook else event.current_stream_wait()
                        if shrink_test:
                            query_mask_buffer_and_check(buffer, mask_status, expected_masked_ranks)
                        live = [not int(mask_status[p]) for p in range(num_ranks)]
                        assert all(int(cost[p]) >= 0 for p in range(num_ranks))
                        check_dispatch_reference(
                            ctx,
                            packed_recv_x,
                            packed_recv_count,
                            handle,
                            cur_xs,
                            dispatch_use_fp8,
                            round_scale,
                            use_ue8m0,
                            live,
                        )
                        checked["dispatch"] += 1
                        packed_recv_x = (
                            (packed_recv_x[0], packed_recv_x[1].contiguous())
                            if dispatch_use_fp8
                            else packed_recv_x
                        )
                        simulated_gemm_x = (
                            per_token_cast_back(
                                packed_recv_x[0].view(-1, hidden),
                                packed_recv_x[1].view(-1, hidden // 128),
                            ).view(packed_recv_x[0].shape)
                            if dispatch_use_fp8
                            else packed_recv_x.clone()
                        )
                        for i in range(num_local_experts):
                            expert_id = rank * num_local_experts + i
                            recv_x = (
                                per_token_cast_back(packed_recv_x[0][i], packed_recv_x[1][i])
                                if dispatch_use_fp8
                                else packed_recv_x[i]
                            )
                            recv_count = packed_recv_count[i]
                            recv_src_info, recv_layout_range = handle[0][i], handle[1][i]
                            int_mask = (2**32) - 1
                            num_valid_tokens = recv_count.item()
                            assert stats[i].item() == num_valid_tokens
                            assert num_valid_tokens == (recv_layout_range & int_mask).sum().item()
                            assert (
                                num_valid_tokens
                                == (all_topk_idx == expert_id)
                                .sum(dim=[1, 2])[mask_status == 0]
                                .sum()
                                .item()
                            )
                            if num_valid_tokens == 0:
                                continue
                            if current_x is x:
                                recv_x = recv_x[:num_valid_tokens]
                                recv_x_amin = recv_x[:, :-128].amin(dim=-1)
                                recv_src_info = recv_src_info[:num_valid_tokens]
                                assert torch.equal(recv_x_amin, recv_x[:, :-128].amax(dim=-1))
                                if round_scale:
                                    assert calc_diff(recv_x[:, -1], recv_src_info.view(-1)) < 0.007
                                else:
                                    assert (
                                        recv_x[:, -128:] - recv_src_info.view(-1, 1) % num_tokens
                                    ).sum().item() == 0
                                for j in range(num_ranks):
                                    if shrink_test and mask_status[j]:
                                        continue
                                    begin_idx = (recv_layout_range[j] >> 32).item()
                                    count = (recv_layout_range[j] & int_mask).item()
                                    if not round_scale:
                                        assert (recv_x_amin == j - rank_offset).sum().item() == (
                                            all_topk_idx[j] == expert_id
                                        ).sum().item()
                                        assert (
                                            recv_x[begin_idx : begin_idx + count, :-128]
                                            - j
                                            + rank_offset
                                        ).sum().item() == 0

                        if shrink_test and simulate_failure_and_skip(
                            rank, "combine", expected_masked_ranks
                        ):
                            break
                        for zero_copy in (False,) if use_logfmt else (False, True):
                            if zero_copy:
                                buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = (
                                    simulated_gemm_x
                                )
                            out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16)
                            ccost = torch.zeros((num_ranks,), dtype=torch.int64)
                            combined_x, event, hook = buffer.low_latency_combine(
                                simulated_gemm_x,
                                topk_idx,
                                topk_weights,
                                handle,
                                use_logfmt=use_logfmt,
                                async_finish=not return_recv_hook,
                                zero_copy=zero_copy,
                                return_recv_hook=return_recv_hook,
                                out=out,
                                combine_wait_recv_cost_stats=ccost,
                            )
                            hook() if return_recv_hook else event.current_stream_wait()
                            assert combined_x is out
                            if shrink_test:
                                query_mask_buffer_and_check(
                                    buffer, mask_status, expected_masked_ranks
                                )
                                owner_by_expert = torch.arange(num_experts) // num_local_experts
                                fail_owner_mask = (mask_status == 1).index_select(
                                    0, owner_by_expert
                                )
                                valid_topk_idx = topk_idx >= 0
                                failed_topk_idx = torch.zeros_like(topk_idx, dtype=torch.bool)
                                failed_topk_idx[valid_topk_idx] = fail_owner_mask.index_select(
                                    0, topk_idx[valid_topk_idx]
                                )
                                topk_idx[failed_topk_idx] = -1
                            diff = calc_diff(
                                current_x
                                * topk_weights.masked_fill(topk_idx == -1, 0)
                                .sum(dim=1)
                                .view(-1, 1),
                                combined_x,
                            )
                            assert torch.isnan(combined_x).sum().item() == 0
                            if not round_scale:
                                assert diff < (9e-4 if dispatch_use_fp8 else 1e-5), (
                                    f"Error: {diff=}, {dispatch_use_fp8=}, {zero_copy=}"
                                )
                            # The reference: the same rows DeepEP's test combines (every expert
                            # is the identity, so y(t, k) is the token's round-tripped row).
                            y = (
                                deepep_fp8(current_x, round_scale)[2].to(torch.bfloat16)
                                if dispatch_use_fp8
                                else current_x
                            )
                            ref = combine_reference(
                                y, topk_idx, topk_weights, torch.zeros_like(topk_idx, dtype=bool)
                            )
                            if use_logfmt:
                                assert calc_diff(ref, combined_x) < 1e-5
                            else:
                                assert torch.equal(
                                    combined_x.view(torch.int16), ref.view(torch.int16)
                                )
                            checked["combine"] += 1

                        if shrink_test:
                            if simulate_failure_and_skip(rank, "clean", expected_masked_ranks):
                                break
                            buffer.clean_low_latency_buffer(num_tokens, hidden, num_experts)
                            query_mask_buffer_and_check(buffer, mask_status, expected_masked_ranks)
    return checked


# ---------------------------------------------------------------------------- ragged 0..max
def ragged(buffer, hidden, num_experts, num_topk):
    """Ranks with 0, 1, M-1 and M tokens (M = 6): receive and combine against the reference."""
    rank, nr = buffer.rank, buffer.num_ranks
    m = 6
    sizes = [0, 1, m - 1, m][:nr]
    inputs = [rank_inputs(7, p, sizes[p], hidden, num_experts, num_topk, False) for p in range(nr)]
    ctx = {
        "rank": rank,
        "num_ranks": nr,
        "num_local": num_experts // nr,
        "all_idx": [inp[1] for inp in inputs],
    }
    xs = [inp[0][-1] for inp in inputs]
    _, idx, w = inputs[rank]
    for n, (fp8, rs, ue) in enumerate(
        ((False, False, False), (True, False, False), (True, True, True), (True, False, False))
    ):
        if n == 3:  # a clean is a barrier round (it moves the buffer parity): still exact after
            buffer.clean_low_latency_buffer(m, hidden, num_experts)
        recv, count, handle, _, _ = buffer.low_latency_dispatch(
            xs[rank], idx, m, num_experts, use_fp8=fp8, round_scale=rs, use_ue8m0=ue
        )
        check_dispatch_reference(ctx, recv, count, handle, xs, fp8, rs, ue, [True] * nr)
        if fp8:
            data, sc = recv[0], recv[1].contiguous()
            y = per_token_cast_back(data.view(-1, hidden), sc.view(-1, hidden // 128))
            y = y.view(data.shape)
        else:
            y = recv
        out, _, _ = buffer.low_latency_combine(y, idx, w, handle)
        yref = deepep_fp8(xs[rank], rs)[2].to(torch.bfloat16) if fp8 else xs[rank]
        ref = combine_reference(yref, idx, w, torch.zeros_like(idx, dtype=bool))
        assert out.shape == (sizes[rank], hidden)
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


def contract_rank(rank: int, num_ranks: int, store_path: str, names: list[str], conn) -> None:
    """deep_ep_procs.launch target: one Buffer per config, its scenario, results by name."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    from moecomm.compat.deep_ep import Buffer

    results = {}
    store = dist.FileStore(store_path, num_ranks)
    for name in names:
        cfg = CONFIGS[name]
        hidden, num_experts, num_tokens, num_topk, _, shrink = cfg
        t0 = time.monotonic()
        buf = None
        try:
            buf = Buffer(
                None,
                0,
                Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts),
                low_latency_mode=True,
                num_qps_per_rank=num_experts // num_ranks,
                explicitly_destroy=True,
                enable_shrink=shrink,
                rank=rank,
                num_ranks=num_ranks,
                store=store,
                store_prefix=name,
                timeout=TIMEOUT_S,
                # Set up here, as DeepEP's constructor does: a rank may fail before any call.
                num_max_dispatch_tokens_per_rank=num_tokens,
                hidden=hidden,
                num_experts=num_experts,
                num_topk=num_topk,
            )
            if shrink:
                # The rendezvous above had the long deadline (8 processes start slowly on 2
                # cores); the failures are detected with a short one, every rank starting
                # together.
                buf.timeout = SHRINK_TIMEOUT_S
                store.add(f"{name}/start", 1)
                while int(store.add(f"{name}/start", 0)) < num_ranks:
                    time.sleep(0.02)
            if name.startswith("ragged"):
                ragged(buf, hidden, num_experts, num_topk)
                out = "ok"
            else:
                checked = test_main(buf, cfg)
                out = "ok" if (checked["dispatch"] or shrink) else f"nothing checked {checked}"
            results[name] = (out, time.monotonic() - t0)
        except BaseException:
            results[name] = (traceback.format_exc(), time.monotonic() - t0)
        finally:
            if shrink:  # the failed ranks stop calling: let the live ones finish first
                store.add(f"{name}/done", 1)
                deadline = time.monotonic() + 60
                while int(store.add(f"{name}/done", 0)) < num_ranks:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
            if buf is not None:
                buf.destroy()
        if results[name][0] != "ok":
            break
    conn.send(results)
