"""difftest: differential testing of EAGLE-3 draft wiring across inference engines."""

__version__ = "0.1.0"
