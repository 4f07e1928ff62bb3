"""The prefill/decode split (docs/router.md).

- :mod:`~moecomm_serving.disagg.schema`: the bodies of the internal ``/pd`` routes;
- :mod:`~moecomm_serving.disagg.transfer`: KV hand-offs between front ends' KV pools, block
  to block (reservations on the decode side, writes from the prefill side);
- :mod:`~moecomm_serving.disagg.routes`: the ``/pd`` routes a prefill or decode front end serves;
- :mod:`~moecomm_serving.disagg.router`: the OpenAI API in front of prefill and decode front ends.
"""
