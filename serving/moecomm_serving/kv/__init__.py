"""The KV cache layer: where a sequence's keys and values live, on one front end and between two.

- :mod:`~moecomm_serving.kv.cache`: a growable buffer per (sequence, layer) and the batch a
  forward runs over (:class:`~moecomm_serving.kv.cache.ForwardBatch`);
- :mod:`~moecomm_serving.kv.blocks`: the paged cache (a block pool, a block table per sequence,
  blocks held for a hand-off between front ends and the metadata checked before one);
- :mod:`~moecomm_serving.kv.prefix_cache`: full blocks kept after their request, found by tokens.

Plain tensors and bookkeeping: no model code.
"""
