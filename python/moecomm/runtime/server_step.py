"""One layer of an expert server's pass: the requests of one layer in, one answer each out,
through warm buffers and, where the client's memory is mapped here, straight into its slot.

Per request: its activations are read once from the request slot — dequantized or converted
into the step's warm token buffer (the :class:`~moecomm.ops.ExpertWorkspace`) — the grouped
expert MLP runs on the workspace, and the per-token result is summed straight into the client's
response slot (``ServerChannel.response_view``), then published with ``commit_response``. A
client whose memory is not mapped here (nixl) is answered from the workspace with ``respond``.

The workspace is sized for the largest request of the clients connected (``need``, raised by
connect) and grown by the loop thread before a pass that needs more, so the hot path allocates
no activation-sized storage (tests/runtime/test_server_step.py counts it).
"""

from __future__ import annotations

import threading

import torch

from moecomm.ops import ExpertWorkspace
from moecomm.ops.quant import dequantize
from moecomm.runtime.experts import LayerExperts
from moecomm.wire.protocol import ENCODING_DTYPE, SlotLayout

# A buffer that must grow grows at least this much, so a creeping load reallocates rarely.
GROWTH = 1.5
# What connects may reserve up front, per activation-sized buffer: a decode layout (128 tokens x
# top-8 x 7168 f32 = 29 MiB) is warm from the first pass, while a prefill layout of thousands of
# tokens per slot does not make an idle server hold gigabytes; steps beyond it grow the buffers
# to what they actually need (once, then warm).
RESERVE_BYTES = 256 << 20


class StepBuffers:
    """The server step's workspace: what connected clients may send at most, and the warm
    buffers for it. ``reserve`` runs on connect (any thread); ``workspace`` on the loop thread."""

    def __init__(self, layers: dict[int, LayerExperts]):
        self._lock = threading.Lock()
        self._need = {"tokens": 0, "rows": 0}
        self._layers = layers
        self.ws: ExpertWorkspace | None = None
        # Answers to clients whose memory is not mapped here are computed into this buffer and
        # then copied out by `respond`; by output dtype, grown like the workspace.
        self._answers: dict[torch.dtype, torch.Tensor] = {}

    def answer_views(self, sizes: list[int], hidden: int, dtype: torch.dtype) -> list:
        """Consecutive warm ``[n, hidden]`` views for answers that cannot go in place."""
        need = sum(sizes)
        buf = self._answers.get(dtype)
        if buf is None or buf.shape[0] < need or buf.shape[1] != hidden:
            rows = max(need, int(GROWTH * (0 if buf is None else buf.shape[0])))
            buf = self._answers[dtype] = torch.zeros(rows, hidden, dtype=dtype)
        return list(buf[:need].split(sizes))

    def reserve(self, layout: SlotLayout, num_slots: int) -> None:
        """A client of `layout` connected: one pass may bring a request of its per slot (the
        reservation is capped by RESERVE_BYTES; bigger steps grow the buffers when they come)."""
        tokens = layout.max_tokens * num_slots
        with self._lock:
            self._need["tokens"] = max(self._need["tokens"], tokens)
            self._need["rows"] = max(self._need["rows"], tokens * layout.topk)

    def workspace(self, layer: LayerExperts) -> ExpertWorkspace:
        """The warm workspace, grown first if a connect raised the need or `layer` is wider."""
        with self._lock:
            tokens, rows = self._need["tokens"], self._need["rows"]
        cap = max(1, RESERVE_BYTES // (layer.hidden * 4))  # rows of f32 activations
        tokens, rows = min(tokens, cap), min(rows, cap)
        if self.ws is None:
            experts = max(le.num_local for le in self._layers.values())
            inter = max(le.intermediate for le in self._layers.values())
            self.ws = ExpertWorkspace(
                max(rows, 1), layer.hidden, inter, max(experts, layer.num_local),
                max(tokens, 1), layer.dtype,
            )  # fmt: skip
        else:
            self.ws.ensure(rows=rows, tokens=tokens, copies=rows, experts=layer.num_local)
        return self.ws


def answer_layer(layer: LayerExperts, items, buffers: StepBuffers, answered, failed) -> None:
    """Computes and answers every request of `items` [(channel, request)] of one layer.
    `answered(ch, req)` / `failed(ch, req, exc)` are told about each answer (a failed answer
    does not stop the others)."""
    ws = buffers.workspace(layer)
    sizes = [req.num_tokens for _, req in items]
    xs = ws.token_views(sizes, dtype=layer.dtype)
    for x, (_, req) in zip(xs, items, strict=True):
        if req.scales is not None:
            dequantize(req.activations, req.scales, req.encoding, dtype=layer.dtype, out=x)
        else:
            x.copy_(req.activations)  # the one read of the slot (with the dtype conversion)
    outs = [ch.response_view(req) for ch, req in items]
    copied = [i for i, o in enumerate(outs) if o is None]
    if copied:  # clients not mapped here (nixl): answers computed into warm scratch, then sent
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in copied:
            by_dtype.setdefault(ENCODING_DTYPE[items[i][0].layout.out_encoding], []).append(i)
        for dtype, idx in by_dtype.items():
            views = buffers.answer_views([sizes[i] for i in idx], layer.hidden, dtype)
            for i, v in zip(idx, views, strict=True):
                outs[i] = v
    layer.forward(
        xs,
        [req.expert_ids for _, req in items],
        [req.scores for _, req in items],
        workspace=ws,
        out=outs,
    )
    for i, ((ch, req), y) in enumerate(zip(items, outs, strict=True)):
        try:
            if i in copied:
                ch.respond(req, y)
            else:
                ch.commit_response(req)
        except Exception as exc:  # this answer only; the batch's others go on
            failed(ch, req, exc)
            continue
        answered(ch, req)
