"""Expert placement: EPLB-compatible replica counts and GPU placement, plus EaaS extensions.

Pure Python + torch; independent of moecomm._C and of the serving layer. See docs/eplb.md.
"""

from .incremental import rebalance_incremental
from .metrics import (
    combine_windows,
    duplicates,
    gpu_loads,
    imbalance,
    imbalance_per_layer,
    replicas_moved,
)
from .policy import place_experts, rebalance_experts
from .redundancy import Placement, gpus_per_expert

__all__ = [
    "Placement",
    "combine_windows",
    "duplicates",
    "gpu_loads",
    "gpus_per_expert",
    "imbalance",
    "imbalance_per_layer",
    "place_experts",
    "rebalance_experts",
    "rebalance_incremental",
    "replicas_moved",
]
