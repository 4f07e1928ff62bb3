"""NIXL-EP's ``nixl_ep`` on moecomm (the face is ``moecomm.compat.nixl_ep``).

- ``buffer.py``: NIXL-EP's ``Buffer``, ``Config`` and ``EventOverlap`` (its Python API).
- ``runtime.py``: what NIXL-EP's C++ runtime is to its Buffer: rank capacity and masks,
  connections made and dropped at run time, the rank bound of a call.
- ``engine.py``: the low-latency engine: ``deep_ep.Buffer``'s host path in shrink mode, with
  channels set up pair by pair.
- ``pairs.py``: the connect handshake through the store, and a pair's control region.
"""
