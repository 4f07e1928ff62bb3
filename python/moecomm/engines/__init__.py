"""Plug-ins that engines load by module path to move their KV cache over moecomm's block
transfer (:mod:`moecomm.wire.kv`), one module per engine:

- ``vllm_kv``: a vLLM v1 KV connector (``KVConnectorBase_V1``, ``SupportsHMA``), loaded with
  ``--kv-transfer-config '{"kv_connector": "MoecommConnector",
  "kv_connector_module_path": "moecomm.engines.vllm_kv", ...}'``.
- ``sglang_kv``: an SGLang disaggregation transfer backend.

Each module imports its engine itself, at import time; this package imports none of them, so
``moecomm`` and ``moecomm.engines`` import without any engine installed.
"""
