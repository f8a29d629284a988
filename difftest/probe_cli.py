"""`difftest probe --server URL --case CASE [--kind sglang|vllm]`: one live-server check, one report.

The same check as `--engines=ref,server[url=...]` in a pytest run (difftest.probe), without
pytest: the reference replays the server's tokens, the verdict and the report (JSON, Markdown,
HTML; `difftest bundle` packs them) are written as for any engine, the tensor checks recorded as
"not available". Exit status: 0 the deployment accepts what the reference predicts, 1 it does
not, 2 the probe could not run (one line naming the cause: unreachable, timeout, no speculative
decoding, another model, a bad case).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SERVER_ENGINE = "engines.server.engine:ServerEngine"


def ensure_server_engine() -> None:
    """Register the `server` engine where the installed metadata predates it (an old editable install)."""
    from difftest.engine import registered_engines

    if "server" not in registered_engines():
        current = os.environ.get("DIFFTEST_ENGINES", "")
        os.environ["DIFFTEST_ENGINES"] = ";".join(filter(None, [current, f"server={SERVER_ENGINE}"]))


def server_spec_text(url: str, kind: str | None, timeout: float, model: str | None) -> str:
    params = [f"url={url}"] + ([f"kind={kind}"] if kind else []) + [f"timeout={timeout:g}"] + ([f"model={model}"] if model else [])
    return f"server[{','.join(params)}]"


def add_parser(sub) -> None:
    p = sub.add_parser("probe", help="check a running SGLang or vLLM server's acceptance against the reference's prediction")
    p.add_argument("--server", required=True, metavar="URL", help="http://HOST:PORT of the running server")
    p.add_argument("--case", required=True, help="the case whose target and draft the server runs (cases/NAME.yaml)")
    p.add_argument("--kind", choices=["sglang", "vllm"], default=None, help="server kind (default: detected)")
    p.add_argument("--reference", default="ref", help="the engine that predicts (default: ref, the case's trained wiring)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per HTTP request to the server (default 120)")
    p.add_argument("--model", default=None, help="the served model's name when it is not the case's target path")
    p.add_argument("--report-dir", default="reports")
    p.add_argument("--engine-timeout", type=float, default=900.0, help="seconds per reference request (default 900)")
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    from difftest import checks
    from difftest import report as report_mod
    from difftest import report_files
    from difftest.case import load_case
    from difftest.records import CheckResult
    from difftest.engine import parse_spec
    from difftest.errors import DifftestError
    from difftest.outputs import check_output_dir
    from difftest.session import Options, Session

    ensure_server_engine()
    report_dir = Path(args.report_dir)
    session = None
    try:
        check_output_dir(report_dir, "--report-dir")  # before the server and the reference are asked anything
        if args.timeout <= 0:
            raise DifftestError(f"--timeout: must be > 0 seconds, got {args.timeout:g}")
        case = load_case(args.case)
        server = parse_spec(server_spec_text(args.server, args.kind, args.timeout, args.model))
        reference = parse_spec(args.reference)
        session = Session(Options(engines=[reference, server], reference=reference, timeout=args.engine_timeout,
                                  log_dir=report_dir / "logs",
                                  progress=lambda m: print(f"[difftest probe] {m}", file=sys.stderr, flush=True)))  # fmt: skip
        session.client(server)  # reachability, speculative decoding: fail before loading the reference
        results = []
        for name in ("fc_inputs", "draft_logits", "top1_agreement"):
            try:
                checks.CHECKS[name](session, case, server)
            except DifftestError as e:  # NotAvailable: a server exposes no tensors
                results.append(CheckResult(server.id, name, "not available", str(e)))
        verdict = checks.check_accept_length(session, case, server)
        results.append(CheckResult(server.id, "accept_length", "passed" if verdict.passed else "failed", verdict.message,
                                   verdict.data))  # fmt: skip
        path = report_files.write(report_mod.build(case, session, results), report_dir)
    except DifftestError as e:
        print(f"difftest probe: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    finally:
        if session is not None:
            session.close()
    print(verdict.message)
    print(f"report: {path} (and {path.with_suffix('.html')})")
    return 0 if verdict.passed else 1
