"""moecomm_serving: the reference serving layer (CLI, model, HTTP front end).

The package imports nothing itself (so ``python -m moecomm_serving.<module>`` runs cleanly);
the model's entry points live in their modules (see docs/model.md):

- ``model``: :func:`load_model`, :class:`MoETransformer` (whole model or one pipeline stage);
- ``backends``: the experts-backend interface and :class:`LocalExperts`;
- ``checkpoint``: :class:`Checkpoint` (strict HF-layout access; ``read_experts`` for servers);
- ``generate``: :class:`Generation`, :func:`step`, :func:`generate`, :class:`SamplingParams`;
- ``kvcache``, ``config``, ``tokenizer``, ``tiny``.
"""
