"""Expert replicas for the DeepEP-shaped adapter's shrink mode (a moecomm extension, opt-in with
``Buffer(..., enable_shrink=True, replicas={expert: [rank, ...]})``; docs/compat-deep-ep.md).

Rank ``r``'s local experts are its ``L`` primary experts ``r*L .. r*L+L-1`` followed by the
experts it hosts as a replica, sorted by expert id (``Buffer.local_experts``). Routing is per
expert and per mask: the primary while it is live, else the first live rank of
``replicas[e]`` in the order given, else the (masked) primary, i.e. dropped as in DeepEP. The
choice is the sender's; the receiver lays out whatever arrives by local index, so ranks that
disagree on the mask for a round route differently but never inconsistently: each copy's answer
comes back from the rank it was sent to, and is dropped only if that rank is masked."""

from __future__ import annotations

import torch

from moecomm.ops.dispatch import ExpertMap


def check_replicas_arg(replicas, reroute_replicas: bool, enable_shrink: bool, num_ranks: int):
    """The ``replicas`` keyword as ``{expert: [ranks]}`` of ints (None when not given)."""
    if replicas is None:
        if reroute_replicas:
            raise NotImplementedError(
                "reroute_replicas: re-routing needs to know where each expert's replicas are: "
                "pass replicas={expert: [ranks hosting a copy]} with enable_shrink=True "
                "(docs/compat-deep-ep.md, shrink mode)"
            )
        return None
    if not enable_shrink:
        raise ValueError("replicas re-route the experts of masked ranks: needs enable_shrink=True")
    if not isinstance(replicas, dict):
        kind = type(replicas).__name__
        raise TypeError(f"replicas must be a dict {{expert: [ranks]}}, got {kind}")
    spec: dict[int, list[int]] = {}
    for e, ranks in replicas.items():
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise ValueError(f"replicas: expert ids must be ints >= 0, got {e!r}")
        ranks = list(ranks)
        if any(isinstance(q, bool) or not isinstance(q, int) for q in ranks):
            raise ValueError(f"replicas[{e}]: ranks must be ints, got {ranks!r}")
        if any(not 0 <= q < num_ranks for q in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(f"replicas[{e}]: distinct ranks in [0, {num_ranks}), got {ranks}")
        if ranks:
            spec[e] = ranks
    return spec


class ReplicaPlan:
    """Where every expert lives (primary first, then its replicas) and how to route per mask."""

    def __init__(self, spec: dict[int, list[int]] | None, num_experts: int, num_ranks: int):
        self.spec = dict(spec or {})
        self.num_experts, self.num_ranks = num_experts, num_ranks
        per = self.per_rank = num_experts // num_ranks
        for e, ranks in self.spec.items():
            if e >= num_experts:
                raise ValueError(f"replicas: expert {e} is not in [0, {num_experts})")
            if e // per in ranks:
                raise ValueError(f"replicas[{e}]: rank {e // per} is its primary, not a replica")
        hosted = [sorted(e for e, rs in self.spec.items() if q in rs) for q in range(num_ranks)]
        self.local = [list(range(q * per, (q + 1) * per)) + hosted[q] for q in range(num_ranks)]
        # Primary first, then the replicas in the order given (the order they are tried in).
        places = [
            [(e // per, e % per)] + [(q, per + hosted[q].index(e)) for q in self.spec.get(e, [])]
            for e in range(num_experts)
        ]
        # Replica ordinal i of expert e (0: the primary) is rank ranks_of[e][i].
        self.ranks_of = [[q for q, _ in p] for p in places]
        self.map = ExpertMap(places, num_ranks)
        self.max_local = max(len(x) for x in self.local)
        self._ordinals: dict[tuple[int, ...], torch.Tensor] = {}

    def wire(self) -> dict:
        """What every rank must agree on (exchanged at set-up)."""
        return {str(e): rs for e, rs in sorted(self.spec.items())}

    def ordinals(self, masked: torch.Tensor) -> torch.Tensor:
        """[E] int64: the place each expert's copies go to under `masked` ([R] bool): the
        primary if live, else the first live replica, else the (masked) primary."""
        key = tuple(bool(m) for m in masked.tolist())
        if key not in self._ordinals:
            pick = []
            for ranks in self.ranks_of:
                live = [i for i, q in enumerate(ranks) if not key[q]]
                pick.append(live[0] if live else 0)
            self._ordinals[key] = torch.tensor(pick, dtype=torch.int64)
        return self._ordinals[key]

    def route(self, topk_idx: torch.Tensor, masked: torch.Tensor) -> tuple:
        """(ordinals [E] for pack_dispatch, dest [T, K] int64 rank of each copy or -1, the
        number of copies whose dest is masked: no live copy, dropped)."""
        pick = self.ordinals(masked)
        dest = self.map.resolve(topk_idx, pick)[0]
        return pick, dest, int((masked[dest.clamp_min(0)] & (dest >= 0)).sum())


def drop_masked(idx: torch.Tensor, dest: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """The combine's topk_idx with -1 where the copy went to (or would have gone to) a rank
    that is masked now: its answer is not (or no longer) waited for."""
    gone = masked[dest.clamp_min(0)] & (idx >= 0) & (dest >= 0)
    return idx.masked_fill(gone, -1) if bool(gone.any()) else idx
