"""vLLM engine adapter: real vLLM EAGLE-3 (pinned: 0.32.0) in vLLM's own environment (see engine.py)."""
