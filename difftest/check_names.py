"""The names of the checks, declared once (checks.py runs them; case files name them)."""

REFERENCE_CHECKS = ("capture", "lint")
ENGINE_CHECKS = ("fc_inputs", "draft_logits", "top1_agreement", "accept_length")
TRAIN_CHECKS = ("train_accuracy",)
ALL_CHECKS = REFERENCE_CHECKS + ENGINE_CHECKS + TRAIN_CHECKS
