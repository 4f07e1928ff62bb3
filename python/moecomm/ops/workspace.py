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

from collections.abc import Sequence

import torch

from moecomm.ops._checks import check_batches, check_tensor
from moecomm.ops.grouped_gemm import (
    _FLOAT_DTYPES,
    _check_contiguous_args,
    _mlp_into,
    _native_ok,
    _run_native,
    _split_native,
    _visit_list,
    combine_rows,
    gather_tokens,
    reorganize,
)
from moecomm.ops.reorg import ExpertLayout

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
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype: expected one of {_FLOAT_DTYPES}, got {dtype}")
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
            if dtype not in _FLOAT_DTYPES:
                raise TypeError(f"dtype: expected one of {_FLOAT_DTYPES}, got {dtype}")
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
    """:func:`~moecomm.ops.grouped_mlp_contiguous` writing into ``out`` (or the workspace's
    expert-output rows), its scratch and index tensors taken from ``ws`` when given."""
    num_experts, inter = _check_contiguous_args(x, offsets, w13, w2, scores)
    n, hidden = x.shape
    if ws is not None:
        ws.ensure(rows=n, experts=num_experts, hidden=hidden, intermediate=inter, dtype=x.dtype)
    if out is None:
        out = ws.buffer("rows_out", n)
    else:
        check_tensor("out", out, dtypes=[x.dtype], dim=2, device=x.device)
        if tuple(out.shape) != (n, hidden) or (n and out.stride(1) != 1):
            raise ValueError(f"out: expected shape [{n}, {hidden}] with unit column stride, "
                             f"got {list(out.shape)} strides {list(out.stride())}")  # fmt: skip
    offs = offsets.tolist()
    rows = [offs[e + 1] - offs[e] for e in range(num_experts)]
    if groups is None:
        # Every expert with rows is visited, so every row of out gets written: no zeroing.
        visit = [e for e in range(num_experts) if rows[e] > 0]
    else:
        visit = _visit_list(groups, None, num_experts)
        out.zero_()  # rows of experts not visited come out zero
    small, large = _split_native(visit, rows, _native_ok(x, w13, w2, scores))
    if small:
        if ws is None:
            _run_native(x, offsets[:-1], offsets[1:] - offsets[:-1], small, w13, w2, scores, out)
        else:
            counts = torch.sub(offsets[1:], offsets[:-1], out=ws.buffer("counts64", num_experts))
            ex = ws.buffer("run", len(small))
            ex.numpy()[:] = small  # a view of the same memory: no tensor is built from the list
            scratch = ws.buffer("inter", n).view(-1)
            _run_native(x, offsets[:-1], counts, small, w13, w2, scores, out, scratch, ex)
    if large and scores is not None and scores.dtype != x.dtype and ws is not None:
        # Converted once for every group (the plain path converts each group's slice alike).
        scores = ws.buffer("row_scores", n).copy_(scores)
    for e in large:
        s, t = offs[e], offs[e + 1]
        sc = None if scores is None else scores[s:t]
        h = None if ws is None else ws.buffer("inter", t - s)
        _mlp_into(out[s:t], x[s:t], w13[e], w2[e], inter, sc, h)
    return out


def expert_forward_into(xs, ids, scores, w13, w2, *, ws, out) -> list[torch.Tensor]:
    """:func:`~moecomm.ops.expert_forward` with a workspace and/or caller-owned outputs."""
    num_experts = int(w13.shape[0])
    if ws is None:  # caller-owned outputs only: the plain step, its result written into out
        layout = reorganize(ids, scores, num_experts)
        x_rows = gather_tokens(xs, layout)
        rows = grouped_mlp_into(
            x_rows, layout.offsets, w13, w2, layout.scores, groups=None,
            out=torch.empty_like(x_rows), ws=None,
        )  # fmt: skip
        return combine_rows(rows, layout, out=out)
    dtype = xs[0].dtype if xs else ws.dtype
    ws.ensure(hidden=int(w13.shape[2]), intermediate=int(w13.shape[1]) // 2, dtype=dtype)
    layout = ws.layout(ids, scores, num_experts)
    n = layout.num_rows
    ws.ensure(rows=n)
    x_rows = gather_tokens(xs, layout, out=ws.buffer("rows_in", n), workspace=ws)
    rows = grouped_mlp_into(
        x_rows, layout.offsets, w13, w2, layout.scores, groups=None, out=None, ws=ws
    )
    return combine_rows(rows, layout, out=out, workspace=ws)
