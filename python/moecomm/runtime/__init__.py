"""The EaaS runtime: expert servers and attention clients over the slot protocol, with an HTTP
control plane for the connect handshake."""

from moecomm.errors import deprecated_aliases
from moecomm.runtime.backend import ExpertsBackend, run_experts
from moecomm.runtime.client import AttentionClient, DispatchHandle
from moecomm.runtime.device_client import DeviceClient, DeviceHandle, DeviceStepFailedError
from moecomm.runtime.device_server import DeviceExpertServer
from moecomm.runtime.experts import ExpertWeights, LayerExperts, random_experts
from moecomm.runtime.server import ExpertServer

# The old names, deprecated: the family's names end in Error (docs/errors.md).
__getattr__ = deprecated_aliases(__name__, {"DeviceStepFailed": "DeviceStepFailedError"})

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
