"""The rendezvous of every API compat answers: each rank's JSON-able dict gathered from every
rank, over a ``torch.distributed`` process group, an mpi4py communicator or a Store."""

from __future__ import annotations

import json
from datetime import timedelta

from moecomm.errors import DeadlineExceededError

__all__ = ["exchange", "group_rank_and_size"]


def group_rank_and_size(group) -> tuple[int, int]:
    """``(rank, size)`` of a ``torch.distributed.ProcessGroup`` (a clear TypeError for anything
    else: the constructors take a process group or moecomm's rank/num_ranks/store)."""
    import torch.distributed as dist

    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup or None, got {type(group).__name__}")
    return group.rank(), group.size()


def exchange(
    mine: dict, rank: int, num_ranks: int, group, store, prefix: str, timeout: float, comm=None
) -> list[dict]:
    """Every rank's `mine`, by rank: one all_gather_object over `group`, one allgather over an
    mpi4py `comm`, else through `store` (keys ``{prefix}/{rank}``)."""
    if comm is not None:
        return list(comm.allgather(mine))
    if group is not None:
        import torch.distributed as dist

        out: list = [None] * num_ranks
        dist.all_gather_object(out, mine, group=group)
        return out
    keys = [f"{prefix}/{p}" for p in range(num_ranks)]
    store.set(keys[rank], json.dumps(mine))
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as exc:  # each store raises its own error type at the deadline
        missing = [p for p, k in enumerate(keys) if not store.check([k])]
        raise DeadlineExceededError(
            f"deep_ep.Buffer rank {rank}: ranks {missing} did not publish their regions "
            f"within {timeout:.1f} s ({exc})"
        ) from exc
    return [json.loads(store.get(k)) for k in keys]
