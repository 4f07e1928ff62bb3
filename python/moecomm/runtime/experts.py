"""Expert weights as a server hosts them, and the monolithic reference MoE layer.

Weights use the Hugging-Face Mixtral / Qwen-MoE names and layouts: w1 = gate [I, H],
w3 = up [I, H], w2 = down [H, I]. An expert computes ``w2 @ (silu(w1 @ x) * (w3 @ x))``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moecomm.ops.grouped_gemm import expert_forward, stack_gate_up

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's MLP: gate w1 [I, H], up w3 [I, H], down w2 [H, I]."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor

    def __post_init__(self):
        for name in ("w1", "w3", "w2"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in _FLOAT_DTYPES:
                got = t.shape if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a 2-D float tensor, got {got}")
        i, h = self.w1.shape
        if self.w3.shape != (i, h) or self.w2.shape != (h, i):
            raise ValueError(
                f"expert shapes disagree: w1 {list(self.w1.shape)}, w3 {list(self.w3.shape)} "
                f"(expected [{i}, {h}]), w2 {list(self.w2.shape)} (expected [{h}, {i}])"
            )
        if not (self.w1.dtype == self.w3.dtype == self.w2.dtype):
            raise ValueError("w1, w3 and w2 must share one dtype")

    @property
    def hidden(self) -> int:
        return self.w1.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w1.shape[0]


class LayerExperts:
    """The experts of one layer that a server hosts; immutable (a placement change builds a new
    one and swaps it in between batches).

    Local index i is logical expert ``slots[i]``, or -1: a retired index. Indices are never
    reused and never renumbered, so a client whose expert map is older than a placement change
    still names the same expert by the same index, or one that is gone (and is told so: stale
    map), never another one. Initially the ids are sorted, so every server numbers the experts
    it starts with the same way. Weights are stored compactly (retired experts take no memory);
    ``rows`` maps local indices to storage rows."""

    def __init__(
        self,
        layer_id: int,
        experts: Mapping[int, ExpertWeights],
        slots: list[int] | None = None,
    ):
        self.layer_id = int(layer_id)
        slots = sorted(int(e) for e in experts) if slots is None else [int(e) for e in slots]
        live = [e for e in slots if e >= 0]
        if not live:
            raise ValueError(f"layer {layer_id}: a hosted layer needs at least one expert")
        if len(set(live)) != len(live) or set(live) != {int(e) for e in experts}:
            raise ValueError(f"layer {layer_id}: local slots {slots} disagree with the experts")
        if min(slots) < -1:
            raise ValueError(f"layer {layer_id}: logical expert ids must be >= 0")
        self.slots = slots
        ws = [experts[e] for e in live]
        shapes = {(w.hidden, w.intermediate, w.w1.dtype) for w in ws}
        if len(shapes) != 1:
            raise ValueError(f"layer {layer_id}: experts differ in shape or dtype: {shapes}")
        self.hidden, self.intermediate, self.dtype = shapes.pop()
        self.w13 = stack_gate_up(torch.stack([w.w1 for w in ws]), torch.stack([w.w3 for w in ws]))
        self.w2 = torch.stack([w.w2 for w in ws]).contiguous()
        row = {e: r for r, e in enumerate(live)}
        self.rows = torch.tensor([row.get(e, -1) for e in slots], dtype=torch.int32)
        self.contiguous = live == slots and live == list(range(len(live)))

    @property
    def logical_ids(self) -> list[int]:
        """The logical experts hosted, in local-index order."""
        return [e for e in self.slots if e >= 0]

    @property
    def num_local(self) -> int:
        """Size of the local index space (retired indices included)."""
        return len(self.slots)

    def local_of(self, expert: int) -> int | None:
        return self.slots.index(expert) if expert in self.slots else None

    def weights(self, expert: int) -> ExpertWeights:
        """A hosted expert's weights (views of the stacked storage)."""
        local = self.local_of(expert)
        if local is None:
            raise KeyError(f"layer {self.layer_id} hosts no expert {expert}")
        r = int(self.rows[local])
        return ExpertWeights(
            self.w13[r, : self.intermediate], self.w13[r, self.intermediate :], self.w2[r]
        )

    def with_expert(self, expert: int, w: ExpertWeights) -> LayerExperts:
        """This layer plus `expert` at a new local index (appended)."""
        return self.with_experts({expert: w})

    def with_experts(self, added: Mapping[int, ExpertWeights]) -> LayerExperts:
        """This layer plus every expert of `added`, at new local indices appended in the order
        given: one rebuild of the stacked weights however many experts come in."""
        if not added:
            raise ValueError(f"layer {self.layer_id}: no expert to add")
        for expert in added:
            if self.local_of(expert) is not None:
                raise ValueError(f"layer {self.layer_id} already hosts expert {expert}")
        experts = {e: self.weights(e) for e in self.logical_ids}
        experts.update({int(e): w for e, w in added.items()})
        return LayerExperts(self.layer_id, experts, [*self.slots, *(int(e) for e in added)])

    def without_expert(self, expert: int) -> LayerExperts | None:
        """This layer with `expert`'s index retired; None when it was the last expert."""
        return self.without_experts([expert])

    def without_experts(self, gone) -> LayerExperts | None:
        """This layer with the indices of every expert in `gone` retired (one rebuild); None
        when no expert is left."""
        gone = {int(e) for e in gone}
        for expert in gone:
            if self.local_of(expert) is None:
                raise KeyError(f"layer {self.layer_id} hosts no expert {expert}")
        experts = {e: self.weights(e) for e in self.logical_ids if e not in gone}
        if not experts:
            return None
        slots = [-1 if e in gone else e for e in self.slots]
        return LayerExperts(self.layer_id, experts, slots)

    def forward(self, xs, ids, scores, *, workspace=None, out=None) -> list[torch.Tensor]:
        """Server step for this layer: y_b = Σ_k score · expert_{ids[b]}(x_b), in float32.
        `ids` are local indices of live experts (or -1); the caller checked them.

        ``workspace`` (a :class:`moecomm.ops.ExpertWorkspace`) and ``out`` (caller-owned
        ``[n_b, H]`` outputs) are passed to :func:`moecomm.ops.expert_forward`; with a workspace
        the dtype conversion and the local-index remap also go into its buffers, so a warm step
        allocates nothing proportional to the tokens."""
        if workspace is None:
            xs = [x if x.dtype == self.dtype else x.to(self.dtype) for x in xs]
            if not self.contiguous:
                ids = [torch.where(i >= 0, self.rows[i.clamp(min=0).long()], -1) for i in ids]
            return expert_forward(xs, ids, scores, self.w13, self.w2, out=out)
        if any(x.dtype != self.dtype for x in xs):
            views = workspace.token_views([x.shape[0] for x in xs], self.dtype)
            xs = [v.copy_(x) for v, x in zip(views, xs, strict=True)]
        if not self.contiguous:
            # table[i + 1] = storage row of local index i; table[0] = -1 stands for "not here".
            table = getattr(self, "_row_table", None)
            if table is None:
                table = torch.cat([torch.tensor([-1], dtype=torch.int32), self.rows])
                self._row_table = table
            ids = workspace.remap_ids(ids, table)
        return expert_forward(xs, ids, scores, self.w13, self.w2, workspace=workspace, out=out)

    def nbytes(self, expert: int | None = None) -> int:
        """Weight bytes of one expert (or of every hosted one)."""
        one = (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()
        return one * (len(self.logical_ids) if expert is None else 1)


def random_experts(
    num_layers: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict[int, dict[int, ExpertWeights]]:
    """Deterministic random weights {layer: {expert: ExpertWeights}} for tests and benchmarks."""
    g = torch.Generator().manual_seed(seed)
    scale_in, scale_mid = hidden**-0.5, intermediate**-0.5
    out: dict[int, dict[int, ExpertWeights]] = {}
    for layer in range(num_layers):
        out[layer] = {}
        for e in range(num_experts):
            w1 = (torch.randn(intermediate, hidden, generator=g) * scale_in).to(dtype)
            w3 = (torch.randn(intermediate, hidden, generator=g) * scale_in).to(dtype)
            w2 = (torch.randn(hidden, intermediate, generator=g) * scale_mid).to(dtype)
            out[layer][e] = ExpertWeights(w1, w3, w2)
    return out
