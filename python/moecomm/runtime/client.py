"""The attention client: dispatch a layer's routed tokens to expert servers, combine answers.

`dispatch` packs one request per server that hosts a chosen replica (quantizing early, before
the copy), writes and signals — it does not wait. `combine` waits with a deadline for every
server contacted and sums the partial results in server order, so the result does not depend on
which answer arrived first. `num_slots` micro-batches can be in flight at once (two give
double-batch overlap: the attention of batch B runs while batch A is with the experts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moecomm.errors import MoecommError
from moecomm.ops.combine import combine as combine_partials
from moecomm.ops.dispatch import ExpertMap, pack_dispatch
from moecomm.protocol import SlotLayout, as_encoding
from moecomm.runtime.control import http_connect, http_disconnect
from moecomm.slots import DEFAULT_TIMEOUT_S, ClientChannel
from moecomm.transport import ShmTransport, Transport

REPLICA_POLICIES = ("round_robin", "least_outstanding")


@dataclass
class DispatchHandle:
    slot: int
    layer_id: int
    num_tokens: int
    # (server index, sequence number, token_index) for every server contacted, in server order
    sent: list
    out_dtype: torch.dtype
    replica: torch.Tensor | None = None  # the replica ordinal chosen for each logical expert
    done: bool = False


class AttentionClient:
    """Client of a set of expert servers, reached by their control-plane URLs."""

    def __init__(
        self,
        servers: Sequence[str],
        client_id: int,
        hidden: int,
        topk: int,
        max_tokens: int,
        encoding: str = "bf16",
        out_dtype: torch.dtype = torch.bfloat16,
        num_slots: int = 2,
        token: str = "",
        timeout: float = DEFAULT_TIMEOUT_S,
        replica_policy: str = "round_robin",
        transport: Transport | None = None,
    ):
        if not servers:
            raise ValueError("an attention client needs at least one expert server")
        if replica_policy not in REPLICA_POLICIES:
            raise ValueError(
                f"replica_policy must be one of {REPLICA_POLICIES}, got {replica_policy!r}"
            )
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.urls = list(servers)
        self.client_id = int(client_id)
        self.layout = SlotLayout(
            max_tokens, hidden, topk, as_encoding(encoding), as_encoding(out_dtype)
        )
        self.encoding = self.layout.encoding
        self.out_dtype = out_dtype
        self.num_slots = num_slots
        self.token = token
        self.timeout = timeout
        self.replica_policy = replica_policy
        self.transport = transport or ShmTransport()
        self.channels: list[ClientChannel] = []
        self.maps: dict[int, ExpertMap] = {}
        self._busy = [False] * num_slots
        self._next_slot = 0
        self._rr = 0
        self.outstanding = [0] * len(self.urls)  # tokens in flight per server

    # ------------------------------------------------------------------ connect
    def connect(self) -> None:
        """Connect handshake with every server; builds the expert map of every layer."""
        hosted = []
        for url in self.urls:
            ch = ClientChannel(
                self.transport, self.layout, self.client_id, self.num_slots, name=f"server {url}"
            )
            try:
                info = http_connect(
                    url,
                    self.client_id,
                    ch.handle,
                    self.layout,
                    self.num_slots,
                    self.token,
                    self.timeout,
                )
                ch.connect(info["server_handle"], info["doorbell_handle"])
            except Exception:
                ch.close()
                self.close()
                raise
            self.channels.append(ch)
            hosted.append({int(k): v for k, v in info["hosted"].items()})
        self.maps = self._build_maps(hosted)

    def _build_maps(self, hosted: list[dict[int, list[int]]]) -> dict[int, ExpertMap]:
        layers = sorted({layer for h in hosted for layer in h})
        maps = {}
        for layer in layers:
            replicas: dict[int, list[tuple[int, int]]] = {}
            for server, h in enumerate(hosted):
                for local, expert in enumerate(h.get(layer, [])):
                    replicas.setdefault(expert, []).append((server, local))
            num_experts = max(replicas) + 1
            missing = [e for e in range(num_experts) if e not in replicas]
            if missing:
                raise MoecommError(f"layer {layer}: no server hosts experts {missing}")
            maps[layer] = ExpertMap(
                [replicas[e] for e in range(num_experts)], num_servers=len(self.urls)
            )
        return maps

    # ------------------------------------------------------------------ data path
    def _replicas(self, emap: ExpertMap, topk_ids: torch.Tensor) -> torch.Tensor | None:
        if self.replica_policy == "round_robin":
            self._rr += 1
            return (self._rr + torch.arange(emap.num_experts)) % emap.num_replicas
        # least outstanding: for every expert, the replica whose server has the fewest tokens
        # in flight (ties to the lower replica ordinal, so the choice is deterministic).
        load = torch.tensor(self.outstanding, dtype=torch.int64)
        choice = torch.zeros(emap.num_experts, dtype=torch.int64)
        for e in range(emap.num_experts):
            servers = [s for s, _ in emap.replicas(e)]
            choice[e] = int(torch.argmin(load[servers]))
        return choice

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer_id: int
    ) -> DispatchHandle:
        """Packs and sends one request per server; returns without waiting."""
        emap = self.maps.get(layer_id)
        if emap is None:
            raise ValueError(
                f"layer {layer_id}: no connected server hosts it "
                f"(known layers: {sorted(self.maps)})"
            )
        if x.dim() != 2 or x.shape[1] != self.layout.hidden:
            raise ValueError(f"x must be [num_tokens, {self.layout.hidden}], got {list(x.shape)}")
        if x.shape[0] > self.layout.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens exceed max_tokens {self.layout.max_tokens}")
        slot = self._take_slot()
        try:
            replica = self._replicas(emap, topk_ids)
            batches = pack_dispatch(
                x, topk_ids, topk_weights, emap, encoding=self.encoding, replica=replica
            )
            sent = []
            for b in batches:
                ch = self.channels[b.server]
                try:
                    seq = ch.send(
                        slot,
                        b.activations,
                        b.expert_ids,
                        b.scores,
                        layer_id=layer_id,
                        scales=b.scales,
                    )
                except MoecommError as exc:
                    raise type(exc)(
                        f"server {self.urls[b.server]} layer {layer_id}: {exc}"
                    ) from exc
                self.outstanding[b.server] += b.num_tokens
                sent.append((b.server, seq, b.token_index, b.num_tokens))
        except Exception:
            self._busy[slot] = False
            raise
        return DispatchHandle(slot, layer_id, x.shape[0], sent, self.out_dtype, replica)

    def combine(self, handle: DispatchHandle, timeout: float | None = None) -> torch.Tensor:
        """Waits for every server of `handle` and sums their partial results (server order)."""
        if handle.done:
            raise ValueError("this handle was already combined")
        timeout = self.timeout if timeout is None else timeout
        partials, index = [], []
        try:
            for server, seq, token_index, _ in handle.sent:
                try:
                    resp = self.channels[server].wait(handle.slot, seq, timeout)
                except MoecommError as exc:
                    raise type(exc)(
                        f"server {self.urls[server]} layer {handle.layer_id}: {exc}"
                    ) from exc
                partials.append(resp.activations)
                index.append(token_index)
            return combine_partials(
                partials,
                index,
                handle.num_tokens,
                hidden=self.layout.hidden,
                dtype=handle.out_dtype,
            )
        finally:
            for server, _, _, n in handle.sent:
                self.outstanding[server] -= n
            handle.done = True
            self._busy[handle.slot] = False

    def _take_slot(self) -> int:
        for i in range(self.num_slots):
            slot = (self._next_slot + i) % self.num_slots
            if not self._busy[slot]:
                self._busy[slot] = True
                self._next_slot = slot + 1
                return slot
        raise RuntimeError(
            f"all {self.num_slots} micro-batch slots are in flight; combine one "
            "before dispatching another"
        )

    def close(self) -> None:
        for url, ch in zip(self.urls, self.channels, strict=False):
            http_disconnect(url, self.client_id, self.token)
            ch.close()
        self.channels = []
