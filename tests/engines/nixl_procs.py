"""vLLM 0.33.0's NIXL-EP path over moecomm's ``nixl_ep``: ``NixlEPPrepareAndFinalize``
(model_executor/layers/fused_moe/prepare_finalize/nixl_ep.py) and ``NixlEPAll2AllManager``
(distributed/device_communicators/all2all.py): its buffer set-up, connect/disconnect, the mask
cycle, and a rank killed. Needs ``moecomm.compat.nixl_ep`` (test_vllm_nixl_ep.py skips, saying
so, while it does not exist).

The manager is vLLM's, on vLLM's parallel state (vllm_procs.setup); the prepare/finalize is built
with the arguments ``all2all_utils.maybe_make_prepare_finalize`` gives it (``num_dispatchers`` =
the manager's ``max_num_ep_ranks``, ``expert_capacity`` = local experts × that). A round is
vllm_procs.ll_round: NIXL-EP's dispatch/combine keep DeepEP's low-latency contract.

CPU stand-ins, and why: ``torch.accelerator.synchronize`` is a no-op (the manager calls it
after mask updates; a CPU-only torch raises "no accelerator"; host calls are complete when they
return), and the manager's mask tensor is set to a CPU tensor before ``query_active_mask``
allocates it with ``device="cuda"``.
"""

from __future__ import annotations

import moe_reference as ref
import torch
import vllm_procs
from vllm_procs import EXPERTS_PER_RANK, H, M

SEED = 57


def setup(ctx) -> None:
    vllm_procs.setup(ctx)
    torch.accelerator.synchronize = lambda device=None: None


teardown = vllm_procs.teardown


def _manager(ctx):
    """vLLM's manager, one per process group (its constructor builds a StatelessProcessGroup
    on the group's store under the prefix "nixl_ep": a second one on the same store would reuse
    its barrier keys; vLLM builds a new one only with a new group, at scale-up/down)."""
    from vllm.distributed.device_communicators.all2all import NixlEPAll2AllManager

    manager = ctx.state.get("nixl_manager")
    if manager is None:
        manager = ctx.state["nixl_manager"] = NixlEPAll2AllManager(ctx.state["ep_group"])
    handle = manager.get_handle(
        dict(max_num_tokens_per_dp_rank=M, token_hidden_size=H, num_local_experts=EXPERTS_PER_RANK)
    )
    NixlEPAll2AllManager._mask = torch.zeros(manager.max_num_ep_ranks, dtype=torch.int32)
    return manager, handle


def _pf(manager, handle, use_fp8: bool):
    from vllm.model_executor.layers.fused_moe.prepare_finalize.nixl_ep import (
        NixlEPPrepareAndFinalize,
    )

    return NixlEPPrepareAndFinalize(
        handle,
        max_tokens_per_rank=M,
        num_dispatchers=manager.max_num_ep_ranks,
        expert_capacity=EXPERTS_PER_RANK * manager.max_num_ep_ranks,
        use_fp8_dispatch=use_fp8,
    )


def prepare_finalize(ctx) -> None:
    """bf16 / fp8 (DeepEP-quantized rows handed through, and dequantized) dispatch, sync and
    async, top-k 8, 5 and 2 on the one buffer the manager keeps (largest first: see
    topk_grows_on_one_buffer)."""
    manager, handle = _manager(ctx)
    seed = SEED
    for topk in (8, 5, 2):
        for mode, do_async in [
            ("bf16", False),
            ("bf16", True),
            ("fp8", True),
            ("fp8-dequant", False),
        ]:
            vllm_procs.ll_round(
                ctx, _pf(manager, handle, mode != "bf16"), seed, topk, mode, do_async
            )
            seed += 1
    assert not bool(manager.query_fault()), "a fault seen with every rank alive"


def topk_grows_on_one_buffer(ctx) -> None:
    """The contract: vLLM keeps one NIXL-EP buffer per process for every MoE layer, so a layer
    with a larger top-k than the first one dispatched (an MTP / draft layer, a second model)
    comes to the same buffer: top-2, then top-8. Runs in a group of its own (the buffer is the
    process's)."""
    manager, handle = _manager(ctx)
    for i, topk in enumerate((2, 8)):
        vllm_procs.ll_round(ctx, _pf(manager, handle, False), SEED + 40 + i, topk, "bf16", False)


def mask_cycle(ctx) -> None:
    """The manager's mask_remote_ranks: every peer masked inside, unmasked after; a round after
    the cycle is complete again."""
    manager, handle = _manager(ctx)
    peers = [p for p in range(ctx.num_ranks) if p != ctx.rank]
    with manager.mask_remote_ranks():
        mask = manager.query_active_mask()
        assert [int(mask[p]) for p in peers] == [1] * len(peers), mask.tolist()
        assert int(mask[ctx.rank]) == 0, mask.tolist()
    assert manager.query_active_mask().tolist() == [0] * ctx.num_ranks
    manager.clean_buffers()
    vllm_procs.ll_round(ctx, _pf(manager, handle, False), SEED + 50, 4, "bf16", False)


def kill_one_rank(ctx) -> None:
    """The last rank is killed (SIGKILL) after a complete round. The others: the next round
    masks it (NIXL-EP is fault tolerant: the manager sets support_fault_tolerance), query_fault
    reports it, the manager disconnects it (its scale-down, _disconnect_to_ep_size) and cleans
    the buffers, and a round among the survivors is exact, copies routed to the dead rank's
    experts counting nothing."""
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
    )

    n, r, local = ctx.num_ranks, ctx.rank, EXPERTS_PER_RANK
    victim = n - 1
    manager, handle = _manager(ctx)
    vllm_procs.ll_round(ctx, _pf(manager, handle, False), SEED + 60, 4, "bf16", False)
    ctx.state["group_broken"] = True
    if r == victim:
        ctx.state["die"] = True
        return
    pf = _pf(manager, handle, False)
    num_experts = local * n
    for seed in (SEED + 61, SEED + 62):
        inputs = [ref.make_inputs(seed, p, M, num_experts, 4, H) for p in range(n)]
        x, idx, w = inputs[r]
        hook, receiver = pf.prepare_async(x, w, idx, num_experts, None, False, _unquantized())
        hook()
        expert_x, _, meta, _, _ = receiver()
        y = torch.zeros(local, pf.max_tokens_per_rank * n, H, dtype=torch.bfloat16)
        for e in range(local):
            ge = r * local + e
            want = [(p, t) for p, t in ref.routed(inputs, ge) if p != victim]
            assert int(meta.expert_num_tokens[e]) == len(want), f"expert {ge} after the kill"
            if want:
                y[e, : len(want)] = ref.expert(expert_x[e, : len(want)].float(), ge)
        out = torch.empty(M, H, dtype=torch.bfloat16)
        pf.finalize(out, y, w, idx, False, TopKWeightAndReduceDelegate())
        live = idx.clone()
        live[(live // local) == victim] = -1
        assert torch.equal(out, ref.ll_combine(x.float(), live, w)), "combine after the kill"
        if seed == SEED + 61:
            assert bool(manager.query_fault()), "the killed rank is not reported"
            assert int(manager.query_active_mask()[victim]) == 1
            manager._disconnect_to_ep_size(victim)
            manager.clean_buffers()


def _unquantized():
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    return FUSED_MOE_UNQUANTIZED_CONFIG


SCENARIOS = {
    "topk_grows_on_one_buffer": topk_grows_on_one_buffer,  # in a group of its own
    "prepare_finalize": prepare_finalize,
    "mask_cycle": mask_cycle,
    "kill_one_rank": kill_one_rank,  # last: the group ends with it
}
