"""The built-in tiny models the cases and tests run on: targets, drafts, training data, chat.

Each provider module is registered under the `difftest.fixtures` entry points (pyproject.toml);
the core reaches them only through those (difftest.run.session.resolve_fixture), and no engine
imports this package. The fixtures use the reference engine's model code (difftest_engines/ref: the
EAGLE-3 draft, its trainer, target loading) and the training-data engine's dump writer as
libraries. Layers, bottom up: cache -> targets -> drafts -> provider -> the providers.
"""
