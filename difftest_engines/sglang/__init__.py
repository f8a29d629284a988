"""The SGLang adapter: the engine worker (engine.py), its capture hooks, the CPU kernel shim and the
release-keyed rules of the SGLang versions it runs (docs/engines.md)."""
