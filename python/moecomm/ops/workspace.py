"""Warm, caller-owned buffers for the expert-server step (the pplx-kernels / DeepEP shape).

An expert server knows its largest step when it connects (slots × tokens per slot × top-k), so
everything :func:`moecomm.ops.expert_forward` needs can be allocated once, up front, and
*written once* there: on Linux a fresh block above glibc's mmap threshold comes back as untouched
pages, and the first write to each 4 KiB page is a page fault. Measured on the "256 hosted, 8
active" bench case, the step's freshly allocated outputs cost ~1 ms of faults per step, more than
everything except the GEMM itself.

With an :class:`ExpertWorkspace` the step allocates no tensor storage whose size grows with the
tokens, the rows or the hidden size (``tests/ops/test_workspace.py`` counts the allocations with
the torch profiler). Results that stay in the workspace are valid until the next step that uses
it; pass ``out=`` to :func:`~moecomm.ops.expert_forward` to have them written elsewhere (e.g.
straight into a response slot).

Reorganization runs in the native counting sort ``moecomm._C.expert_layout`` (``torch.sort``
allocates an index temporary of 8 bytes per copy even with ``out=``). Without the extension, or
on another device, the workspace still holds the step's rows, but the layout is built by the
allocating :func:`~moecomm.ops.reorg.reorganize`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from moecomm.ops._checks import FLOAT_DTYPES, check_batches, check_tensor, check_weights
from moecomm.ops.grouped_gemm import (
    GemmScratch,
    ShrunkGroups,
    expert_forward,
    grouped_mlp_contiguous,
)
from moecomm.ops.reorg import (
    CombineScratch,
    ExpertLayout,
    check_activations,
    combine_rows,
    gather_tokens,
    reorganize,
    tokens_view,
)

__all__ = ["ExpertWorkspace", "expert_forward_into", "grouped_mlp_into"]

# Room for this many client batches per step before the (tiny) batch-offset buffer grows: a
# server takes one request per client slot per poll, and 64 covers every deployment we run.
DEFAULT_MAX_BATCHES = 64
# A capacity that must grow grows to at least this factor of the old one, so a load that creeps
# upward reallocates O(log) times, not once per step.
GROWTH_FACTOR = 1.5

# name: (capacity it is sized by, columns as a function of (hidden, intermediate), dtype kind).
# Capacities: "rows" = layout rows N (copies routed here), "copies" = tokens × topk of a step,
# "tokens", "experts", "batches". dtype kind: "act" = the workspace dtype, or a fixed dtype.
_BUFFERS = {
    # Layout (ExpertLayout fields and the counting sort's inputs/scratch).
    "ids": ("copies", None, torch.int32),
    "scores_in": ("copies", None, torch.float32),
    "slot_of": ("copies", None, torch.int64),
    "src_token": ("copies", None, torch.int64),
    "src_batch": ("copies", None, torch.int32),
    "src_row": ("copies", None, torch.int32),
    "src_k": ("copies", None, torch.int32),
    "scores": ("copies", None, torch.float32),
    # LayerExperts' local-index → storage-row remap of the ids (two: an index can't be its output).
    "remap_a": ("copies", None, torch.int32),
    "remap_b": ("copies", None, torch.int32),
    "counts": ("experts", None, torch.int32),
    "counts64": ("experts", None, torch.int64),
    "offsets": ("experts+1", None, torch.int64),
    "cursor": ("experts", None, torch.int64),
    "active": ("experts", None, torch.int32),
    # The experts handed to the native MLP (the visit list as int32).
    "run": ("experts", None, torch.int32),
    "batch_offsets": ("batches+1", None, torch.int64),
    # Rows: gathered activations, the router scores in the activation dtype (torch path), the
    # gate|up product (the native kernel's scratch in f32, the torch path's h otherwise), expert
    # outputs.
    "rows_in": ("rows", "hidden", "act"),
    "row_scores": ("rows", None, "act"),
    "inter": ("rows", "2*intermediate", "act"),
    "rows_out": ("rows", "hidden", "act"),
    # Tokens: concatenated / dequantized activations, the f32 accumulator of the combine.
    "tokens": ("tokens", "hidden", "act"),
    "acc": ("tokens", "hidden", torch.float32),
}
# Only when the activations are half precision: expert outputs widened to f32 for the combine,
# and the per-token result in the activation dtype (f32 results are the accumulator itself).
_HALF_ONLY = {
    "rows_f32": ("rows", "hidden", torch.float32),
    "result": ("tokens", "hidden", "act"),
}


def _layout_kernel():
    """moecomm._C.expert_layout, or None in a source checkout without the built extension."""
    try:
        from moecomm import _C
    except ImportError:
        return None
    return getattr(_C, "expert_layout", None)


def _positive(name: str, v: object, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {v!r}")
    return v


class ExpertWorkspace:
    """Every buffer of one expert-server step, allocated and first-touched at construction.

    Args:
        max_rows: layout rows (token copies routed to this server) of the largest step; also the
            initial room for tokens × topk copies. Typically ``max_tokens × topk``.
        hidden: H.
        intermediate: I of the experts (the gate|up product is ``[rows, 2I]``).
        num_experts: E, local expert indices.
        max_tokens: tokens of the largest step, over all its batches.
        dtype: the activations' (and experts') dtype.
        device: where the buffers live (default CPU, the native path's home).

    A step that needs more grows the buffers (:meth:`ensure`) — an allocation, on that step only.
    """

    def __init__(
        self,
        max_rows: int,
        hidden: int,
        intermediate: int,
        num_experts: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        *,
        device: torch.device | str | None = None,
    ):
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype: expected one of {FLOAT_DTYPES}, got {dtype}")
        self.hidden = _positive("hidden", hidden)
        self.intermediate = _positive("intermediate", intermediate)
        self.dtype = dtype
        self.device = torch.device("cpu" if device is None else device)
        self._cap = {
            "rows": _positive("max_rows", max_rows, 0),
            "copies": _positive("max_rows", max_rows, 0),
            "tokens": _positive("max_tokens", max_tokens, 0),
            "experts": _positive("num_experts", num_experts),
            "batches": DEFAULT_MAX_BATCHES,
        }
        self._buf: dict[str, torch.Tensor] = {}
        self._np_batch_offsets = None
        self._allocate(set(self._cap))

    # -- sizes -----------------------------------------------------------------------------------

    @property
    def max_rows(self) -> int:
        return self._cap["rows"]

    @property
    def max_tokens(self) -> int:
        return self._cap["tokens"]

    @property
    def num_experts(self) -> int:
        return self._cap["experts"]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buf.values())

    def _specs(self) -> dict:
        half = self.dtype != torch.float32
        return {**_BUFFERS, **(_HALF_ONLY if half else {})}

    def _allocate(self, grown: set[str]) -> None:
        """(Re)allocates every buffer sized by a capacity in ``grown``, zero-filled: torch.zeros
        writes each page, so the step never takes the first-touch faults."""
        cols = {None: None, "hidden": self.hidden, "2*intermediate": 2 * self.intermediate}
        for name, (cap, col, dt) in self._specs().items():
            if cap.removesuffix("+1") not in grown and name in self._buf:
                continue
            n = self._cap[cap.removesuffix("+1")] + cap.endswith("+1")
            shape = (n,) if cols[col] is None else (n, cols[col])
            dtype = self.dtype if dt == "act" else dt
            self._buf[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        for name in set(self._buf) - set(self._specs()):
            del self._buf[name]
        bo = self._buf["batch_offsets"]
        # A numpy view of the same memory: setting the offsets from Python ints allocates nothing.
        self._np_batch_offsets = bo.numpy() if bo.device.type == "cpu" else None

    def ensure(
        self,
        *,
        rows: int = 0,
        tokens: int = 0,
        copies: int = 0,
        experts: int = 0,
        batches: int = 0,
        hidden: int | None = None,
        intermediate: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> bool:
        """Grows the buffers to hold a step of this size (and shape/dtype); True if it allocated.

        Each capacity that is too small becomes ``max(need, GROWTH_FACTOR × old)``. A different
        hidden / intermediate size or dtype reallocates the buffers that depend on it.
        """
        need = {"rows": rows, "tokens": tokens, "copies": copies, "experts": experts}
        need["batches"] = batches
        grown = set()
        for k, v in need.items():
            if v > self._cap[k]:
                self._cap[k] = max(int(v), int(self._cap[k] * GROWTH_FACTOR))
                grown.add(k)
        if hidden is not None and hidden != self.hidden:
            self.hidden = _positive("hidden", hidden)
            grown |= {"rows", "tokens"}
        if intermediate is not None and intermediate != self.intermediate:
            self.intermediate = _positive("intermediate", intermediate)
            grown.add("rows")
        if dtype is not None and dtype != self.dtype:
            if dtype not in FLOAT_DTYPES:
                raise TypeError(f"dtype: expected one of {FLOAT_DTYPES}, got {dtype}")
            self.dtype = dtype
            grown |= {"rows", "tokens"}
        if grown:
            self._allocate(grown)
        return bool(grown)

    def buffer(self, name: str, n: int) -> torch.Tensor:
        """The first ``n`` entries (rows) of buffer ``name``; the caller ensured the capacity."""
        return self._buf[name][:n]

    def token_views(self, sizes: Sequence[int], dtype: torch.dtype | None = None):
        """Consecutive ``[n_b, H]`` views of the token buffer, one per batch: dequantize (or copy)
        each request into its view and :func:`~moecomm.ops.expert_forward` gathers from the
        buffer without concatenating it first."""
        self.ensure(tokens=sum(sizes), dtype=dtype)
        return list(self._buf["tokens"][: sum(sizes)].split(list(sizes)))

    # -- reorganization --------------------------------------------------------------------------

    def layout(
        self, ids: Sequence[torch.Tensor], scores: Sequence[torch.Tensor], num_experts: int
    ) -> ExpertLayout:
        """:func:`~moecomm.ops.reorg.reorganize` into this workspace: the same layout, bit for
        bit; its tensors are views of the workspace, valid until the next step. Built by the
        allocating torch version when the native kernel can't run here (see the module doc).
        """
        topk, device = check_batches(ids, scores, num_experts)
        kernel = _layout_kernel()
        if kernel is None or device.type != "cpu" or self.device.type != "cpu" or topk == 0:
            return reorganize(ids, scores, num_experts)
        sizes = [int(i.shape[0]) for i in ids]
        tokens = sum(sizes)
        copies = tokens * topk
        self.ensure(tokens=tokens, copies=copies, experts=num_experts, batches=len(ids))
        bo = self._np_batch_offsets
        bo[0] = 0
        for b, n in enumerate(sizes):
            bo[b + 1] = bo[b] + n
        ids_flat, sc_flat = self._buf["ids"], self._buf["scores_in"]
        pos = 0
        for i, s in zip(ids, scores, strict=True):
            n = i.numel()
            ids_flat[pos : pos + n].view(i.shape).copy_(i)
            sc_flat[pos : pos + n].view(s.shape).copy_(s)
            pos += n
        buf = self._buf
        rows, _ = kernel(
            ids_flat.data_ptr(), sc_flat.data_ptr(), copies, topk,
            buf["batch_offsets"].data_ptr(), len(ids), num_experts, buf["counts"].data_ptr(),
            buf["offsets"].data_ptr(), buf["cursor"].data_ptr(), buf["active"].data_ptr(),
            buf["src_token"].data_ptr(), buf["src_batch"].data_ptr(), buf["src_row"].data_ptr(),
            buf["src_k"].data_ptr(), buf["scores"].data_ptr(), buf["slot_of"].data_ptr(),
        )  # fmt: skip
        return ExpertLayout(
            num_experts=num_experts,
            topk=topk,
            counts=buf["counts"][:num_experts],
            offsets=buf["offsets"][: num_experts + 1],
            src_batch=buf["src_batch"][:rows],
            src_row=buf["src_row"][:rows],
            src_k=buf["src_k"][:rows],
            src_token=buf["src_token"][:rows],
            scores=buf["scores"][:rows],
            batch_offsets=buf["batch_offsets"][: len(ids) + 1],
            slot_of=buf["slot_of"][:copies].view(tokens, topk),
        )

    # -- the step: the kernels of reorg and grouped_gemm, run in these buffers --------------------

    def gather_tokens(
        self, xs: Sequence[torch.Tensor], layout: ExpertLayout, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:func:`~moecomm.ops.reorg.gather_tokens`; batches that are not consecutive rows of
        one buffer (:meth:`token_views` makes them so) are concatenated into this workspace."""
        check_activations(xs, layout)
        room = None
        if xs and tokens_view(xs) is None:
            total = sum(int(x.shape[0]) for x in xs)
            self.ensure(tokens=total, hidden=int(xs[0].shape[1]), dtype=xs[0].dtype)
            room = self._buf["tokens"]
        return gather_tokens(xs, layout, out, room=room)

    def grouped_mlp(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        scores: torch.Tensor | None = None,
        *,
        groups: ShrunkGroups | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:func:`~moecomm.ops.grouped_mlp_contiguous` writing into ``out`` (default: this
        workspace's expert-output rows, valid until its next step), its scratch and index
        tensors taken from here."""
        check_tensor("x", x, dtypes=FLOAT_DTYPES, dim=2)
        n, hidden = x.shape
        num_experts, inter = check_weights(w13, w2, hidden, x.dtype, x.device)
        self.ensure(rows=n, experts=num_experts, hidden=hidden, intermediate=inter, dtype=x.dtype)
        buf = self._buf
        scratch = GemmScratch(buf["counts64"], buf["run"], buf["inter"], buf["row_scores"])
        out = buf["rows_out"][:n] if out is None else out
        return grouped_mlp_contiguous(
            x, offsets, w13, w2, scores, groups=groups, out=out, scratch=scratch
        )

    def combine_rows(
        self, rows: torch.Tensor, layout: ExpertLayout, out: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """:func:`~moecomm.ops.reorg.combine_rows` summing in this workspace's accumulator;
        without ``out`` the result is views of it, valid until the next step."""
        scratch = None
        # Other rows (float64, wrong shape) go to combine_rows unchanged, which sums them in
        # memory of its own or names what is wrong.
        if (
            isinstance(rows, torch.Tensor)
            and rows.dtype in FLOAT_DTYPES
            and rows.dim() == 2
            and rows.shape[0] == layout.num_rows
        ):
            n, hidden = rows.shape
            self.ensure(tokens=layout.num_tokens, rows=n, hidden=hidden, dtype=rows.dtype)
            buf = self._buf
            scratch = CombineScratch(buf["acc"], buf.get("rows_f32"), buf.get("result"))
        return combine_rows(rows, layout, out, scratch=scratch)

    def forward(
        self,
        xs: Sequence[torch.Tensor],
        ids: Sequence[torch.Tensor],
        scores: Sequence[torch.Tensor],
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """:func:`~moecomm.ops.expert_forward` in this workspace: layout, gathered rows, expert
        outputs and the combine's accumulator are its buffers; the result goes into ``out``
        (caller-owned ``[n_b, H]`` tensors) or stays here, valid until the next step."""
        check_tensor("w13", w13, dtypes=FLOAT_DTYPES, dim=3)
        dtype = xs[0].dtype if xs else self.dtype
        self.ensure(hidden=int(w13.shape[2]), intermediate=int(w13.shape[1]) // 2, dtype=dtype)
        layout = self.layout(ids, scores, int(w13.shape[0]))
        n = layout.num_rows
        self.ensure(rows=n)
        x_rows = self.gather_tokens(xs, layout, self._buf["rows_in"][:n])
        rows = self.grouped_mlp(x_rows, layout.offsets, w13, w2, layout.scores)
        return self.combine_rows(rows, layout, out)

    def remap_ids(self, ids: Sequence[torch.Tensor], table: torch.Tensor) -> list[torch.Tensor]:
        """``table[i + 1]`` for every id i of every batch (``table[0]`` stands for -1), written
        into workspace views: LayerExperts' local index → storage row, without allocating."""
        copies = sum(i.numel() for i in ids)
        self.ensure(copies=copies)
        shifted, mapped = self._buf["remap_a"], self._buf["remap_b"]
        out, pos = [], 0
        for i in ids:
            n = i.numel()
            src, dst = shifted[pos : pos + n], mapped[pos : pos + n]
            torch.add(i.reshape(-1), 1, out=src)
            torch.index_select(table, 0, src, out=dst)
            out.append(dst.view(i.shape))
            pos += n
        return out


def grouped_mlp_into(x, offsets, w13, w2, scores, *, groups, out, ws) -> torch.Tensor:
    """Deprecated: ``ws.grouped_mlp(...)``, or :func:`~moecomm.ops.grouped_mlp_contiguous`."""
    warnings.warn(
        "grouped_mlp_into is deprecated; call ws.grouped_mlp(...) or grouped_mlp_contiguous(...)",
        DeprecationWarning,
        stacklevel=2,
    )
    if ws is None:
        return grouped_mlp_contiguous(x, offsets, w13, w2, scores, groups=groups, out=out)
    return ws.grouped_mlp(x, offsets, w13, w2, scores, groups=groups, out=out)


def expert_forward_into(xs, ids, scores, w13, w2, *, ws, out) -> list[torch.Tensor]:
    """Deprecated: :func:`~moecomm.ops.expert_forward` with ``workspace=ws, out=out``."""
    warnings.warn(
        "expert_forward_into is deprecated; call expert_forward(..., workspace=ws, out=out)",
        DeprecationWarning,
        stacklevel=2,
    )
    return expert_forward(xs, ids, scores, w13, w2, workspace=ws, out=out)
