"""A running SGLang or vLLM server as an engine (difftest.server_client)."""
