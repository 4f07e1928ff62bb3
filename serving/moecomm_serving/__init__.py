"""moecomm_serving: the reference serving layer, in layers that import only those below them.

- :mod:`moecomm_serving.kv`: the KV cache (growable and paged), the prefix cache, the package
  format a request's cache travels in;
- :mod:`moecomm_serving.model`: the reference MoE transformer — config, checkpoint, tokenizer,
  chat template, layers, families, the tiny checkpoint, and where the experts run;
- :mod:`moecomm_serving.engine`: generation, continuous batching, the pipelined model;
- :mod:`moecomm_serving.api`: the OpenAI API — schemas, routes, the front end's app, metrics;
- :mod:`moecomm_serving.disagg`: the prefill/decode split — its schema, routes, KV transfer and
  the router;
- :mod:`moecomm_serving.cli`: the ``moecomm`` command, the only layer that starts processes.

The package imports nothing itself (so ``python -m moecomm_serving.<module>`` runs cleanly).
"""
