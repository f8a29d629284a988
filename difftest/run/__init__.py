"""Floor 7, running engines: the engine interface (engine), the worker process (worker), the
session that captures and compares (session), engine environments (envs), stored baselines
(baseline), the phase clock (timings) and `wiring: infer` per case (infer_case)."""
