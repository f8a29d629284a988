"""Domain errors. Each renders as one line that names the file, field or tensor at fault."""


class DifftestError(Exception):
    """Base class: a problem the user can fix, reported without a traceback."""


class ConfigError(DifftestError):
    """Bad input: a case file, a checkpoint, an engine spec, a wiring."""


class EngineError(DifftestError):
    """An engine failed, crashed or hung; the message carries its last error line and log path."""


class EngineSpent(EngineError):
    """The engine failed in a way its process cannot recover from (e.g. an engine whose second start
    after a failed one hangs): the worker answers with this error and then ends, so that the next
    case gets a fresh process instead of inheriting the failure."""


class Unsupported(DifftestError):
    """The engine does not implement an optional operation (e.g. re-running its draft on golden inputs)."""


class EngineUnavailable(DifftestError):
    """The engine is not installed; the message says how to set it up."""


class CaseNotConfigured(DifftestError):
    """A case names an environment variable that is not set here (e.g. the path of a model too
    large for this machine): its items skip with this reason instead of failing."""


class NotAvailable(DifftestError):
    """A check that cannot apply to this engine (e.g. tensor checks on a running server, which
    exposes no tensors): reported as "not available", never as passed."""
