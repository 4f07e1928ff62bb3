"""The reference MoE model (Mixtral / Qwen2-MoE / Qwen3-MoE / DeepSeek-V3), inference only.

- what a checkpoint is: :mod:`~moecomm_serving.model.config`,
  :mod:`~moecomm_serving.model.rope`, :mod:`~moecomm_serving.model.checkpoint`,
  :mod:`~moecomm_serving.model.tokenizer`, :mod:`~moecomm_serving.model.chat_template`, and
  :mod:`~moecomm_serving.model.tiny` (a tiny random one for the demo and the tests);
- how it computes: :mod:`~moecomm_serving.model.layer`, :mod:`~moecomm_serving.model.deepseek`,
  :mod:`~moecomm_serving.model.transformer` (``load_model``, ``MoETransformer``);
- where its routed experts run: :mod:`~moecomm_serving.model.experts` (the backend seam, in
  process), :mod:`~moecomm_serving.model.remote_experts` (on expert servers),
  :mod:`~moecomm_serving.model.device_experts` (through the GPU path).
"""
