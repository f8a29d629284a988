"""A running SGLang or vLLM server as an engine (engines.server.client)."""
