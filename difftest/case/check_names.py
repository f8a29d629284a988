"""The names of the checks, declared once (checks.py runs them; case files name them)."""

REFERENCE_CHECKS = ("capture", "lint")
ENGINE_CHECKS = ("fc_inputs", "draft_logits", "top1_agreement", "accept_length")
ALL_CHECKS = REFERENCE_CHECKS + ENGINE_CHECKS  # the core's own


def known_checks() -> tuple[str, ...]:
    """The core's checks and those installed engines contribute (difftest.base.extensions), e.g. the
    training-data engine's train_accuracy and chat_template."""
    from difftest.base.extensions import own_items

    return ALL_CHECKS + tuple(n for n in own_items() if n not in ALL_CHECKS)
