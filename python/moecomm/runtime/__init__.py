"""The EaaS runtime: expert servers and attention clients over the slot protocol, with an HTTP
control plane for the connect handshake."""

from moecomm.runtime.client import AttentionClient, DispatchHandle
from moecomm.runtime.experts import ExpertWeights, LayerExperts, random_experts
from moecomm.runtime.server import ExpertServer

__all__ = [
    "AttentionClient",
    "DispatchHandle",
    "ExpertServer",
    "ExpertWeights",
    "LayerExperts",
    "random_experts",
]
