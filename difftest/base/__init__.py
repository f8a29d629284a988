"""Floor 1, the base: errors, paths, tensor names, file readers and writers (JSON, YAML, tensors,
atomic outputs), content digests, settings, the definitions of every reported figure, and the
registries of what installed packages contribute (engines, checks, commands, drafts). Imports
nothing else of difftest."""
