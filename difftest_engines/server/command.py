"""`difftest probe --server URL --case CASE [--kind sglang|vllm]`: one live-server check, one report.
Contributed to the CLI by the `server` engine through the `difftest.commands` entry point `probe`
(difftest.base.extensions), as any engine contributes a command.

The same check as `--engines=ref,server[url=...]` in a pytest run (difftest_engines.server.probe), without
pytest: the reference replays the server's tokens, the verdict and the report (JSON, Markdown,
HTML; `difftest bundle` packs them) are written as for any engine, the tensor checks recorded as
"not available". Exit status: 0 the deployment accepts what the reference predicts, 1 it does
not, 2 the probe could not run (one line naming the cause: unreachable, timeout, no speculative
decoding, another model, a bad case).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from difftest.api import Command, deprecated_alias, non_empty
from difftest_engines.server.engine import ServerEngine

NAME = "server"  # the name this package registers its engine under (pyproject.toml, difftest.engines)
SERVER_ENGINE = f"{ServerEngine.__module__}:{ServerEngine.__name__}"
PROBE_CHECK = "difftest_engines.server.probe:CHECK"
PROBE_COMMAND = f"{__name__}:PROBE"


def _register(variable: str, name: str, target: str, known: dict[str, str]) -> None:
    if known.get(name) != target:
        os.environ[variable] = ";".join(filter(None, [os.environ.get(variable, ""), f"{name}={target}"]))


def ensure_server_engine() -> None:
    """Register the `server` engine, its accept-length check and `difftest probe` where the installed
    metadata predates them (an old editable install: `pip install -e .` refreshes it), through the
    variables the registries read besides entry points (DIFFTEST_ENGINES, DIFFTEST_CHECKS,
    DIFFTEST_COMMANDS); a process started after this call inherits them."""
    from difftest.api import registered_engines
    from difftest.api import CHECK_GROUP, COMMAND_GROUP, registered

    _register("DIFFTEST_ENGINES", NAME, SERVER_ENGINE, registered_engines())
    _register("DIFFTEST_CHECKS", "server_accept_length", PROBE_CHECK, registered(CHECK_GROUP))
    _register("DIFFTEST_COMMANDS", "probe", PROBE_COMMAND, registered(COMMAND_GROUP))


def server_spec_text(url: str, kind: str | None, timeout: float, model: str | None) -> str:
    params = (
        [f"url={url}"]
        + ([f"kind={kind}"] if kind else [])
        + [f"timeout={timeout:g}"]
        + ([f"model={model}"] if model else [])
    )
    return f"server[{','.join(params)}]"


def _seconds(text: str) -> float:
    """--timeout's value, seconds > 0: argparse makes a refusal a usage error (exit 4), as any bad option value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def _url(text: str) -> str:
    """--server's value, http(s)://HOST[:PORT][/...]: refused by the parser (exit 4) naming --server, not
    later as a parameter of an `--engines server[url=...]` spec the user never wrote (the client's rule)."""
    # no comma or bracket anywhere: the URL travels inside a server[url=...] spec, which those would split
    if not re.fullmatch(r"https?://[^/\s,\[\]]+(/[^\s,\[\]]*)?", text):
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {text!r}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", required=True, type=_url, metavar="URL", help="http://HOST:PORT of the running server")
    p.add_argument("--case", required=True, help="the case whose target and draft the server runs (cases/NAME.yaml)")
    p.add_argument("--kind", choices=["sglang", "vllm"], default=None, help="server kind (default: detected)")
    p.add_argument(
        "--reference", default="ref", help="the engine that predicts (default: ref, the case's trained wiring)"
    )
    p.add_argument(
        "--timeout", type=_seconds, default=120.0, help="seconds per HTTP request to the server (default 120)"
    )
    p.add_argument(
        "--model",
        type=non_empty("give the served model's name or leave it out"),
        default=None,
        help="the served model's name when it is not the case's target path",
    )
    p.add_argument("--out", dest="report_dir", default="reports", help="where the report goes (default: reports)")
    deprecated_alias(p, ["--report-dir"], "--out", "report_dir")
    p.add_argument("--engine-timeout", type=float, default=900.0, help="seconds per reference request (default 900)")


def main(args: argparse.Namespace) -> int:
    from difftest.api import checks
    from difftest.api import report as report_mod
    from difftest.api import report_files
    from difftest.api import load_case
    from difftest.api import CheckResult
    from difftest.api import parse_spec
    from difftest.api import DifftestError
    from difftest.api import check_output_dir
    from difftest.api import Options, Session

    ensure_server_engine()
    report_dir = Path(args.report_dir)
    session = None
    try:
        check_output_dir(report_dir, "--out")  # before the server and the reference are asked anything
        case = load_case(args.case)
        server = parse_spec(server_spec_text(args.server, args.kind, args.timeout, args.model))
        reference = parse_spec(args.reference)
        session = Session(
            Options(
                engines=[reference, server],
                reference=reference,
                timeout=args.engine_timeout,
                log_dir=report_dir / "logs",
                progress=lambda m: print(f"[difftest probe] {m}", file=sys.stderr, flush=True),
            )
        )
        session.pool.client(server)  # reachability, speculative decoding: fail before loading the reference
        results = []
        for name in ("fc_inputs", "draft_logits", "top1_agreement"):
            try:
                checks.run_check(name, session.run(case), server)
            except DifftestError as e:  # NotAvailable: a server exposes no tensors
                results.append(CheckResult(server.id, name, "not available", str(e)))
        verdict = checks.run_check("accept_length", session.run(case), server)  # difftest_engines.server.probe.CHECK
        results.append(
            CheckResult(
                server.id, "accept_length", "passed" if verdict.passed else "failed", verdict.message, verdict.data
            )
        )
        path = report_files.write(report_mod.build(session.run(case).record(results)), report_dir)
    except DifftestError as e:
        print(f"difftest probe: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    finally:
        if session is not None:
            session.close()
    print(verdict.message)
    print(f"report: {path} (and {path.with_suffix('.html')})")
    return 0 if verdict.passed else 1


PROBE = Command(
    "probe",
    "check a running SGLang or vLLM server's acceptance against the reference's prediction",
    add_arguments,
    main,
)
