"""The serving engine: requests through the model.

- :mod:`~moecomm_serving.engine.generate`: sampling parameters, sampling, batched generation;
- :mod:`~moecomm_serving.engine.scheduler`: continuous batching on one engine thread, and the
  token / finish / error events it emits;
- :mod:`~moecomm_serving.engine.stages`: the reference model as pipeline stages;
- :mod:`~moecomm_serving.engine.pipeline`: a pipeline of stages behind the model interface the
  engine drives.
"""
