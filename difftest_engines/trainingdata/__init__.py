"""Offline training data (speculators, SpecForge) as a difftest engine."""
