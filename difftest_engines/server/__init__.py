"""A running SGLang or vLLM server as an engine (difftest_engines.server.client)."""
