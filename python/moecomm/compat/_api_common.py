"""What the DeepEP-shaped APIs of ``moecomm.compat.deep_ep`` and ``moecomm.compat.nixl_ep``
share: the top-k index dtype and the error of a call moecomm refuses by name."""

from __future__ import annotations

import torch

# ``deep_ep.topk_idx_t`` / ``nixl_ep.topk_idx_t`` (the C++ ``topk_idx_t``, int64 in their
# default builds).
topk_idx_t = torch.int64


def refused(api: str, method: str, why: str) -> NotImplementedError:
    """The error of ``{api}.Buffer.{method}``, a call moecomm does not implement."""
    return NotImplementedError(f"{api}.Buffer.{method} is not implemented by moecomm: {why}")
