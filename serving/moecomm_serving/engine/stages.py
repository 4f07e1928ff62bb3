"""The reference model as DynaPipe pipeline stages (``moecomm.pipeline``).

:class:`ModelStage` is the :class:`moecomm.pipeline.stage.StageCompute` of one stage: it loads
the weights of every layer it may own (``preload``), runs whichever contiguous range it owns at
the moment, keeps a :class:`SequenceKV` per sequence holding only the owned layers, and exports /
imports one layer's caches when the layer map moves that layer. Its MoE layers run their
experts in-process, or on expert servers through the stage's own
:class:`moecomm.runtime.AttentionClient` (every stage process connects one; all share the
servers). :func:`model_pipeline` builds a :class:`moecomm.pipeline.driver.Pipeline` over a
checkpoint directory.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch
from moecomm.pipeline.driver import Pipeline
from moecomm.pipeline.scheduler import max_moves
from moecomm.pipeline.stage import stage_host
from moecomm.wire.protocol import SlotLayout

from moecomm_serving.engine.generate import sample_next
from moecomm_serving.kv.cache import ForwardBatch, LayerKV, SequenceKV
from moecomm_serving.model.config import MoEConfig
from moecomm_serving.model.remote_experts import RemoteExperts, connect_experts
from moecomm_serving.model.transformer import LOCAL, load_model
from moecomm_serving.types import SamplingParams

# Tokens per micro-batch the activation slots are sized for: a few prompts' prefill at once.
DEFAULT_MAX_TOKENS = 512
# Only dtypes with an unquantized slot encoding can travel between stages as they are.
_ENCODINGS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class ModelStage:
    """One stage's share of the model. Layer ids are global."""

    def __init__(
        self,
        path: str,
        preload: range,
        owned: range,
        dtype: torch.dtype | None,
        sampling: SamplingParams | None = None,
        remote: RemoteExperts | None = None,
        max_tokens: int = 0,
        client_id: int | None = None,
        return_logits: bool = False,
    ):
        # A driver that samples itself (the front end's engine, with per-request parameters)
        # takes the logits of each sequence's last row instead of a token.
        self.return_logits = return_logits
        self.client = None
        if remote is not None:
            c = MoEConfig.from_file(path)
            self.client = connect_experts(
                remote, c.hidden_size, c.num_experts_per_tok, max_tokens, client_id, dtype
            )
        try:
            experts = LOCAL if self.client is None else self.client
            self.model = load_model(path, experts=experts, layers=preload, dtype=dtype)
        except BaseException:
            self.close()
            raise
        # Greedy by default; otherwise every sequence draws from its own generator seeded by
        # (params.seed + sequence id), so its tokens do not depend on the micro-batch it is in.
        self.sampling = sampling or SamplingParams()
        self.generators: dict[int, torch.Generator | None] = {}
        self.kv_shape = self.model.kv_shape  # (heads, key width, value width)
        self.owned = owned
        self.seqs: dict[int, SequenceKV] = {}
        self.batch: ForwardBatch | None = None

    def set_layers(self, layers: range) -> None:
        self.owned = layers

    def _new_sequence(self) -> SequenceKV:
        m = self.model
        heads, k_dim, v_dim = self.kv_shape
        return SequenceKV(self.owned, heads, k_dim, m.dtype, m.device, v_dim)

    def begin(self, seq_ids: Sequence[int], past: Sequence[int], num_new: Sequence[int]) -> None:
        # ForwardBatch.build reads each cache's length, which is undefined while a migrated
        # layer is still in flight; the driver knows the lengths, so the batch is built here.
        caches = []
        for sid, p in zip(seq_ids, past, strict=True):
            if sid not in self.seqs:
                if p != 0:
                    raise RuntimeError(f"sequence {sid} is unknown here but has {p} tokens")
                self.seqs[sid] = self._new_sequence()
            caches.append(self.seqs[sid])
        starts, positions, t = [], [], 0
        for p, n in zip(past, num_new, strict=True):
            starts.append(t)
            positions.append(torch.arange(p, p + n, dtype=torch.int64))
            t += n
        pos = torch.cat(positions).to(self.model.device)
        self.batch = ForwardBatch(caches, list(num_new), list(past), starts, pos)
        self.seq_ids = list(seq_ids)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed(tokens)

    def layer(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        m = self.model
        return m.block(layer).forward(h, self.batch, m.rope, m.experts)

    def sample(self, h: torch.Tensor):
        logits = self.model.logits(h.index_select(0, self.batch.last_rows()))
        if self.return_logits:
            # numpy pickles by value over the control pipe; a tensor would travel as a
            # shared-memory handle tied to this process's lifetime.
            return logits.numpy()
        params = self.sampling
        if params.greedy:
            return [int(t) for t in torch.argmax(logits, dim=-1)]
        out = []
        for row, sid in enumerate(self.seq_ids):
            if sid not in self.generators:
                self.generators[sid] = torch.Generator().manual_seed((params.seed or 0) + sid)
            out.append(sample_next(logits[row], params, self.generators[sid]))
        return out

    def export_kv(self, layer: int) -> dict[str, torch.Tensor]:
        out = {}
        for sid, seq in self.seqs.items():
            kv = seq.pop_layer(layer)
            n = kv.length
            out[f"{sid}.k"] = kv.k[:, :n].contiguous().cpu()
            out[f"{sid}.v"] = kv.v[:, :n].contiguous().cpu()
        return out

    def import_kv(self, layer: int, package: dict[str, torch.Tensor]) -> None:
        m = self.model
        for sid in {int(name.split(".")[0]) for name in package}:
            seq = self.seqs.get(sid)
            if seq is None:
                continue  # finished (freed here) after the source exported it
            heads, k_dim, v_dim = self.kv_shape
            kv = LayerKV(heads, k_dim, m.dtype, m.device, v_dim)
            kv.append(package[f"{sid}.k"], package[f"{sid}.v"])
            seq.put_layer(layer, kv)

    def free(self, seq_ids: Sequence[int]) -> None:
        for sid in seq_ids:
            self.seqs.pop(sid, None)
            self.generators.pop(sid, None)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def _make_stage(
    path: str,
    dtype_name: str | None,
    sampling: SamplingParams | None,
    remote: RemoteExperts | None,
    max_tokens: int,
    client_id: int | None,
    return_logits: bool,
    index: int,
    preload: range,
    owned: range,
):
    dtype = getattr(torch, dtype_name) if dtype_name else None
    here = stage_host()
    if remote is not None and remote.host is not None and here is not None:
        # A stage on another host reaches the expert servers from that host's address.
        remote = dataclasses.replace(remote, host=here)
    # One attention client per stage process: ids must differ, so a given base id is offset.
    cid = None if client_id is None else client_id + index
    return ModelStage(path, preload, owned, dtype, sampling, remote, max_tokens, cid, return_logits)


def model_pipeline(
    path: str,
    num_stages: int,
    k_max: int | None = None,
    initial_k: int = 0,
    num_slots: int | None = None,
    dtype: torch.dtype = torch.float32,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    timeout_s: float | None = None,
    sampling: SamplingParams | None = None,
    remote: RemoteExperts | None = None,
    client_id: int | None = None,
    return_logits: bool = False,
    stage_hosts: Sequence[str | None] | None = None,
    transport: str | None = None,
    host: str | None = None,
    stage_token: bytes | str = b"",
) -> Pipeline:
    """Spawns `num_stages` stage processes over the checkpoint at `path`.

    `k_max` (default: as many as the last stage can give) bounds the layers the scheduler may
    move, and so what each upstream stage preloads; `num_slots` (default: one per stage) is
    the number of micro-batches in flight; `sampling` (default greedy) is how the last stage
    picks tokens (temperature / top-p with per-sequence seeds, as ``generate`` does);
    `remote` (default: in-process experts) names the expert servers every stage's MoE layers
    call, each stage through its own attention client (ids `client_id + stage`, random by
    default); `return_logits` makes the last stage return logits rows instead of tokens.
    `stage_hosts` (one entry per stage: "local" / None, or the HOST:PORT of a stage agent,
    ``python -m moecomm.pipeline.agent``), `transport`, `host` and `stage_token` place stages
    on other hosts (see :class:`moecomm.pipeline.driver.Pipeline`); the checkpoint must be at
    `path` on those hosts too.
    """
    if dtype not in _ENCODINGS:
        raise ValueError(f"dtype must be one of {sorted(map(str, _ENCODINGS))}, got {dtype}")
    config = MoEConfig.from_file(path)
    n = config.num_hidden_layers
    k_max = max_moves(n, num_stages) if k_max is None else k_max
    layout = SlotLayout(max_tokens, config.hidden_size, 1, _ENCODINGS[dtype], _ENCODINGS[dtype])
    factory = functools.partial(
        _make_stage,
        str(path),
        str(dtype).removeprefix("torch."),
        sampling,
        remote,
        max_tokens,
        client_id,
        return_logits,
    )
    kwargs = {} if timeout_s is None else {"timeout_s": timeout_s}
    kwargs.update(stage_hosts=stage_hosts, transport=transport, host=host, stage_token=stage_token)
    return Pipeline(
        factory, n, num_stages, layout, k_max, initial_k, num_slots or num_stages, **kwargs
    )
