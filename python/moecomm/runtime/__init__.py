"""The EaaS runtime: expert servers and attention clients over the slot protocol, with an HTTP
control plane for the connect handshake."""

from moecomm.runtime.backend import ExpertsBackend, run_experts
from moecomm.runtime.client import AttentionClient, DispatchHandle
from moecomm.runtime.device_client import DeviceClient, DeviceHandle, DeviceStepFailedError
from moecomm.runtime.device_server import DeviceExpertServer
from moecomm.runtime.experts import ExpertWeights, LayerExperts, random_experts
from moecomm.runtime.server import ExpertServer

__all__ = [
    "AttentionClient",
    "DeviceClient",
    "DeviceExpertServer",
    "DeviceHandle",
    "DeviceStepFailedError",
    "DispatchHandle",
    "ExpertServer",
    "ExpertWeights",
    "ExpertsBackend",
    "LayerExperts",
    "random_experts",
    "run_experts",
]
