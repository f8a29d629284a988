"""The exit codes `difftest run` and `pytest` with the plugin end with: one per kind of outcome, so
a CI tells a regression from a typo in a case file from an engine that never started.

pytest's own codes are kept where they already mean one of these (1, 3, 4, 5): a `pytest.UsageError`
leaves pytest before the plugin can rewrite anything, so a usage error has to be pytest's 4.

The other commands (report, bundle, fix, rules, versions, env create, probe and the engine packages'
train-acc, dump, infer-wiring, preview) answer a question: 0 and 1 are their answer (`fix`: fixed or
not; `probe`: the server passes or not), and TROUBLE, 2 as in diff and grep, says the command could
not answer: its input or output could not be used, or the engine it drove failed, in one line that
names which. A misspelt option or bad option value is USAGE for every command (difftest.base.cli_args).
"""

from __future__ import annotations

from dataclasses import dataclass

OK = 0
REGRESSION = 1  # a check failed: an engine diverges from the reference (or from a baseline)
TROUBLE = 2  # a command other than run could not answer (module docstring): never from run or pytest
INTERNAL = 3  # pytest's: a harness bug
USAGE = 4  # a bad option or option value (pytest's UsageError, and every difftest command's parser)
NO_CASES = 5  # pytest's: nothing collected
CONFIG = 6  # a case file, or the draft/target config it names, cannot be used
ENGINE = 7  # an engine is not installed or could not start (without --allow-missing-engines)
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as a shell reports it)


@dataclass(frozen=True)
class ExitCode:
    code: int
    meaning: str


# in the order they win when several apply: the first that applies is the run's code
TABLE: tuple[ExitCode, ...] = (
    ExitCode(INTERRUPTED, "interrupted (Ctrl-C)"),
    ExitCode(USAGE, "usage error: an unknown or misspelt option, a bad option value"),
    ExitCode(CONFIG, "configuration error: a case file, or the draft/target config it names"),
    ExitCode(ENGINE, "an engine is not installed or could not start (--allow-missing-engines skips instead)"),
    ExitCode(REGRESSION, "regression: a check failed"),
    ExitCode(INTERNAL, "internal error in difftest (a harness bug)"),
    ExitCode(NO_CASES, "no case was collected"),
    ExitCode(
        TROUBLE,
        "not from run: another command (report, bundle, fix, rules, versions, env, probe, ...) could not "
        "answer: its input or output could not be used, or its engine failed",
    ),
    ExitCode(OK, "every check passed (or was skipped by choice)"),
)

# the kinds a failed item is filed under, most important first (see TABLE)
FAILURE_KINDS: dict[str, int] = {"config": CONFIG, "engine": ENGINE, "regression": REGRESSION}


def worst(kinds: set[str]) -> int:
    """The run's code from the kinds of its failed items (FAILURE_KINDS keys); OK when none failed."""
    for kind, code in FAILURE_KINDS.items():
        if kind in kinds:
            return code
    return OK


def help_text() -> str:
    """The table as `--help` prints it."""
    return "exit codes: " + "; ".join(f"{e.code} {e.meaning}" for e in sorted(TABLE, key=lambda e: e.code))
