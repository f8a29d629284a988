"""Floor 3, engine knowledge as data: which target layers each engine release feeds a draft
(layer_rules, engine_releases, wiring), how it reads a draft checkpoint (draft_rules), the lint rules
on a checkpoint (lint_checkpoint, checkpoint_integrity, weight_files), config overlays, and the
wiring inference. Builds on the records and the base only."""
