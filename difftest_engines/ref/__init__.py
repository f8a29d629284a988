"""Reference engine: transformers target + plain-PyTorch EAGLE-3 draft (see engine.py, eagle3.py)."""
