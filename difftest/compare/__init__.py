"""Floor 5, comparison: two captures tensor by tensor (compare, rowstats and its native kernel),
against a measured noise floor (noise) and a case's tolerances; the accept-length gate (accept_gate)
and the diagnosis of a divergence (diagnose). Reads records, never runs an engine."""
