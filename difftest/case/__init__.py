"""Floor 4, the case: a case file validated into a dataclass (case), its known failures
(expected_failure), the names of the checks it may name (check_names) and its chat prompts (chat)."""
