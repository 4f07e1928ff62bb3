"""NIXL-EP's ``nixl_ep`` module on moecomm: the names NIXL-EP's ``nixl_ep/__init__.py`` binds
(``Buffer``, ``EventOverlap``, ``Config``, ``topk_idx_t``) and nothing else, so that an engine can
import this module as ``nixl_ep`` (opt-in, ``engines/alias``: ``MOECOMM_AS_NIXL_EP=1``). The
implementation is in :mod:`moecomm.compat.nixl_ep_impl`; docs/compat-nixl-ep.md describes it."""

# `as topk_idx_t`: bound beside __all__ (not in it), as NIXL-EP binds it.
from moecomm.compat.api import topk_idx_t as topk_idx_t
from moecomm.compat.nixl_ep_impl.buffer import Buffer, Config, EventOverlap

# NIXL-EP's own __all__.
__all__ = ["Buffer", "Config", "EventOverlap"]
