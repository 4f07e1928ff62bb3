"""The OpenAI-compatible HTTP API.

- :mod:`~moecomm_serving.api.openai`: the request schemas, their checks, the response shapes;
- :mod:`~moecomm_serving.api.routes`: the OpenAI routes over any source of token events;
- :mod:`~moecomm_serving.api.app`: the front end's app over the continuous-batching engine;
- :mod:`~moecomm_serving.api.metrics`: serving metrics in the Prometheus text format.
"""
