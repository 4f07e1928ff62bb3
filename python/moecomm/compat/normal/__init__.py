"""DeepEP's normal (high-throughput) mode on the host transport, answered for ``deep_ep.Buffer``
and under ``deep_ep.ElasticBuffer``.

- ``mode.py``: ``NormalMode`` (get_dispatch_layout / dispatch / combine with DeepEP's semantics)
  and ``NormalCalls``, the Buffer's methods it answers.
- ``mailbox.py``: byte packages and the all-to-all between ranks they travel by.
"""
