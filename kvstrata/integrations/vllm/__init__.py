"""kvstrata as a vLLM KV connector: vLLM keeps device memory (its paged KV), kvstrata adds host and
storage.

Load it with `--kv-transfer-config '{"kv_connector": "KvstrataConnector",
"kv_connector_module_path": "kvstrata.integrations.vllm.connector", "kv_role": "kv_both",
"kv_connector_extra_config": {...}}'` (keys: kvstrata.integrations.vllm.config).
"""
