"""DeepEP's ``Buffer`` (``moecomm.compat.deep_ep.Buffer``): its low-latency API on moecomm's slot
protocol, host and CUDA paths.

- ``buffer.py``: the ``Buffer`` class: constructor, rendezvous, dispatch/combine entry points,
  DeepEP's static helpers, the calls refused by name (normal mode mixed in from ``normal/``).
- ``host.py``: the host path (CPU tensors over shared memory): request rounds, shrink masks,
  ``clean_low_latency_buffer``, sending, receiving and reducing.
- ``device.py``: the CUDA path (CUDA tensors on the device kernels over CUDA IPC): the lanes and
  the Buffer's CUDA half.
- ``device_ops.py``: the pure-torch halves of the CUDA path (no kernel, no host read).
- ``layout.py``: shape and argument checks, slot sizing and sequence numbering, the handle, the
  receive layout and the combine's reduction (pure torch, no communication).
- ``cast.py``: DeepEP's fp8 cast and LogFMT-10 round trip, bit for bit.
- ``replicas.py``: moecomm's opt-in expert replicas for shrink mode.
"""
