"""The device expert map of a :class:`moecomm.runtime.DeviceClient`.

Per layer, logical expert ``e`` -> ``(server[e], local[e])``: the peer index of the lowest live
server hosting ``e`` and the expert's local index there, ``-1`` when no live server hosts it (the
dispatch kernels drop such ids). The dispatch kernels read the map through raw device pointers,
and a CUDA graph captured once replays with the pointers it saw at capture: so each layer's two
tensors are allocated **once**, at a capacity that never changes (``max_experts`` entries, the
``num_experts`` every launch passes), and every membership change (add, evict, re-add) rewrites
them in place, with a copy on the current stream. A graph captured before a failover routes by
the new map at its next replay.

Capacity rule: an expert id ``>= max_experts`` cannot be mapped without moving the tensors, so a
server hosting one is refused (:class:`ExpertCapacityError`, raised before the server is
connected) rather than the map being grown under a captured graph; build the client with a
larger ``max_experts``. The default covers today's routed-expert counts (DeepSeek-V3 256,
Kimi K2 384, Qwen3-Next 512) at 8 bytes per expert and layer.

Device-independent: the tests build it with ``device="cpu"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moecomm.errors import MoecommError

__all__ = ["DEFAULT_MAX_EXPERTS", "ExpertCapacityError", "ExpertMaps"]

# Logical experts per layer a client can map (see the capacity rule above).
DEFAULT_MAX_EXPERTS = 1024
# What the kernels read for "no server": route_expert drops negative servers and locals.
NO_SERVER = -1

# peer index -> {layer: logical expert of each local index (-1: retired)}
Hosted = Mapping[int, Sequence[int]]


class ExpertCapacityError(MoecommError, ValueError):
    """A server hosts an expert id the client's fixed-size maps cannot hold."""


class ExpertMaps:
    """Per-layer ``(server, local)`` int32 tensors of ``max_experts`` entries on ``device``,
    allocated when a layer first appears and only ever rewritten in place afterwards."""

    def __init__(self, device: torch.device | str, max_experts: int = DEFAULT_MAX_EXPERTS):
        if max_experts < 1:
            raise ValueError(f"max_experts must be >= 1, got {max_experts}")
        self.device = torch.device(device)
        self.max_experts = int(max_experts)
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # layer -> experts with a live server, kept on the host: routable() never reads the device
        self._routable: dict[int, frozenset[int]] = {}

    def check(self, hosted: Hosted, who: str = "a server") -> None:
        """Raises :class:`ExpertCapacityError` if ``hosted`` ({layer: experts}) names an expert
        the maps cannot hold."""
        for layer, experts in hosted.items():
            for expert in experts:
                if expert >= self.max_experts:
                    raise ExpertCapacityError(
                        f"{who} hosts expert {expert} of layer {layer}, beyond this client's "
                        f"max_experts={self.max_experts}: the device expert maps have a fixed "
                        "size (captured CUDA graphs keep their address); build the DeviceClient "
                        f"with max_experts > {expert}"
                    )

    def update(self, servers: Mapping[int, Hosted]) -> None:
        """Rewrites every layer's map from the live servers (peer index -> {layer: experts}):
        each expert goes to the lowest peer index hosting it (replicas are spread by the
        caller's placement, not here). Layers seen before keep their tensors, with ``-1`` where
        no live server hosts an expert any more."""
        for index, hosted in servers.items():
            self.check(hosted, f"server {index}")
        chosen: dict[int, dict[int, tuple[int, int]]] = {}
        for index in sorted(servers):
            for layer, experts in servers[index].items():
                per_layer = chosen.setdefault(layer, {})
                for local, expert in enumerate(experts):
                    if expert >= 0:
                        per_layer.setdefault(expert, (index, local))
        for layer in sorted(set(self._tensors) | set(chosen)):
            server = torch.full((self.max_experts,), NO_SERVER, dtype=torch.int32)
            local = torch.full((self.max_experts,), NO_SERVER, dtype=torch.int32)
            for expert, (s, i) in chosen.get(layer, {}).items():
                server[expert], local[expert] = s, i
            if layer not in self._tensors:
                self._tensors[layer] = (
                    torch.empty(self.max_experts, dtype=torch.int32, device=self.device),
                    torch.empty(self.max_experts, dtype=torch.int32, device=self.device),
                )
            dev_server, dev_local = self._tensors[layer]
            # In place, on the current stream: after the launches already queued there (they
            # read the old map), before any later one.
            dev_server.copy_(server)
            dev_local.copy_(local)
            self._routable[layer] = frozenset(chosen.get(layer, {}))

    def clear(self) -> None:
        """No server hosts anything (the tensors stay, all ``-1``)."""
        self.update({})

    def __contains__(self, layer: int) -> bool:
        return layer in self._tensors

    @property
    def layers(self) -> list[int]:
        return sorted(self._tensors)

    def tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's ``(server, local)`` device tensors, ``[max_experts]`` int32 each."""
        return self._tensors[layer]

    def routable(self, layer: int) -> set[int]:
        """Logical experts of ``layer`` that have a live server."""
        return set(self._routable.get(layer, ()))
