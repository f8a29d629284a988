"""Floor 4, the case: a case file validated into a dataclass (case), its known failures
(expected_failure) and its chat prompts (chat)."""
