"""Adapters with the APIs engines already call, backed by moecomm, grouped by the API they
answer. The public faces are two plain modules, each exporting exactly its upstream's names:

- ``deep_ep.py``: DeepEP's ``deep_ep`` (``Buffer``, ``ElasticBuffer``, ``EPHandle``, ``Config``,
  events, ``topk_idx_t``, the domain sizes).
- ``nixl_ep.py``: NIXL-EP's ``nixl_ep`` (``Buffer``, ``Config``, ``EventOverlap``,
  ``topk_idx_t``).

Behind them:

- ``low_latency/``: DeepEP's ``Buffer`` and its low-latency API (host and CUDA paths).
- ``normal/``: DeepEP's normal mode (the Buffer's ``dispatch``/``combine``, under ElasticBuffer).
- ``elastic.py``: DeepEP V2's ``ElasticBuffer`` and ``EPHandle``.
- ``nixl_ep_impl/``: NIXL-EP's ``Buffer`` (its runtime, engine and pairs of ranks).
- ``api.py``: DeepEP's module-level objects every API shares (``Config``, events,
  ``topk_idx_t``, the domain sizes, the error of a refused call).
- ``rendezvous.py``: the exchange of every rank's set-up dict (process group, mpi4py or Store).
"""

from moecomm.compat import deep_ep

__all__ = ["deep_ep"]
