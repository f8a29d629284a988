#!/usr/bin/env python3
"""Try the MLA EAGLE-3 draft (tiny-deepseek-v3-eagle3-mla) beside tiny-deepseek-v3 in real engines.

For each engine (default: vllm, sglang) and each draft config variant it runs the shipped case
cases/tiny_deepseek_v3_mla_draft.yaml through the harness, exactly as a user would

    .venv/bin/pytest <case> --engines=ref,ENGINE --out=reports/mla-try

and records what happened: every check's outcome and message, the accept lengths, the largest
difference on each draft tensor, and on failure the engine's first error line and its log. A
variant changes the draft's config.json through the engine's `draft_config_overrides` (same
weights), e.g. `--variant model_type=deepseek_v3` shows what vLLM does with a DeepSeek-V3-typed
draft, `--variant model_type=kimi_k2` what it does with lightseekorg's Kimi checkpoints' type.

Output: reports/mla-try/summary.md and summary.json (reports/ is not tracked; runs accumulate). Engine runs take
minutes each on CPU; nothing here needs a GPU (see scripts/gpu_check.sh for the GPU run).

    .venv/bin/python scripts/try_mla_draft.py                       # shipped config, vllm + sglang
    .venv/bin/python scripts/try_mla_draft.py --engines vllm --variant model_type=deepseek_v3
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CASE = ROOT / "cases" / "tiny_deepseek_v3_mla_draft.yaml"
OUT = ROOT / "reports" / "mla-try"


def variant_case(overrides: dict[str, str], engine: str) -> Path:
    """The shipped case, or a copy whose engine settings overlay the draft config (in reports/, untracked).
    The copy sits in a directory named `cases` because that is what the harness collects."""
    if not overrides:
        return CASE
    case = yaml.safe_load(CASE.read_text())
    settings = case.setdefault("engines", {}).setdefault(engine, {})
    settings.setdefault("draft_config_overrides", {}).update(overrides)
    name = CASE.stem + "_" + "_".join(f"{k}-{v}" for k, v in overrides.items())
    path = OUT / "cases" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(case, sort_keys=False))
    return path


def first_error(log: Path) -> str:
    """The last exception line of the engine's log (the cause, after vLLM/SGLang wrapping)."""
    if not log.exists():
        return ""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", ln) or "Value error," in ln]
    return errors[-1][:600] if errors else ""


def run(engine: str, overrides: dict[str, str], timeout: int) -> dict:
    case = variant_case(overrides, engine)
    report_dir = OUT / (engine + ("-" + "-".join(f"{k}={v}" for k, v in overrides.items()) if overrides else ""))
    cmd = [sys.executable, "-m", "pytest", str(case), f"--engines=ref,{engine}", f"--out={report_dir}", "-q"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    result: dict = {
        "engine": engine,
        "variant": overrides,
        "command": " ".join(cmd),
        "rc": proc.returncode,
        "seconds": round(time.time() - t0, 1),
        "checks": [],
        "draft_max_abs": {},
    }
    report = report_dir / f"{case.stem}.json"
    if not report.exists():
        result["error"] = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        return result
    data = json.loads(report.read_text())
    for check in data["checks"]:
        result["checks"].append(
            {
                "engine": check["engine"],
                "check": check["check"],
                "outcome": check["outcome"],
                "message": check["message"].splitlines()[0][:400],
            }
        )
        if check["check"] == "accept_length" and check.get("data"):
            result["accept_length"] = {side: check["data"][side]["accept_length"] for side in ("reference", "engine")}
    for prompt in data.get("comparisons", {}).get(engine, []):
        for t in prompt["tensors"]:
            if t["name"].startswith("draft.") and t.get("max_abs") is not None:
                result["draft_max_abs"][t["name"]] = max(result["draft_max_abs"].get(t["name"], 0.0), t["max_abs"])
    if proc.returncode != 0:
        result["engine_error"] = first_error(report_dir / "logs" / f"{engine}.log")
        result["log"] = str(report_dir / "logs" / f"{engine}.log")
    return result


def markdown(results: list[dict]) -> str:
    out = ["# MLA EAGLE-3 draft in real engines (tiny-deepseek-v3 + tiny-deepseek-v3-eagle3-mla, CPU)", ""]
    for r in results:
        variant = ", ".join(f"{k}={v}" for k, v in r["variant"].items()) or "shipped config"
        out += [f"## {r['engine']}: {variant}", "", f"`{r['command']}` -> rc {r['rc']} in {r['seconds']}s", ""]
        for c in r["checks"]:
            out.append(f"- {c['engine']}::{c['check']}: **{c['outcome']}**: {c['message']}")
        if "accept_length" in r:
            out.append(
                f"- accept length: reference {r['accept_length']['reference']:.3f}, engine {r['accept_length']['engine']:.3f}"
            )
        if r["draft_max_abs"]:
            worst = max(r["draft_max_abs"].items(), key=lambda kv: kv[1])
            out.append(
                f"- largest draft-tensor difference: {worst[0]} max|d| {worst[1]:.2e} ({len(r['draft_max_abs'])} tensors)"
            )
        if r.get("engine_error"):
            out.append(f"- engine error: `{r['engine_error']}` (log: {r['log']})")
        if r.get("error"):
            out.append("- harness output: " + " / ".join(r["error"]))
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="vllm,sglang", help="comma-separated (default: vllm,sglang)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="draft config overrides to try as well (repeatable); the shipped config always runs",
    )
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per engine run")
    args = parser.parse_args(argv)
    variants: list[dict[str, str]] = [{}]
    for v in args.variant:
        pairs = dict(p.split("=", 1) for p in v.split(","))
        variants.append(pairs)
    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    for engine in [e for e in args.engines.split(",") if e]:
        for overrides in variants:
            print(f"[try-mla] {engine} {overrides or 'shipped config'} ...", flush=True)
            r = run(engine, overrides, args.timeout)
            results.append(r)
            print(f"[try-mla]   rc {r['rc']} in {r['seconds']}s {r.get('engine_error', '')}", flush=True)
    # earlier runs of other engines / variants stay in the summary; a rerun replaces its own entry
    summary = OUT / "summary.json"
    earlier = json.loads(summary.read_text()) if summary.exists() else []
    ran = {(r["engine"], json.dumps(r["variant"], sort_keys=True)) for r in results}
    merged = [r for r in earlier if (r["engine"], json.dumps(r["variant"], sort_keys=True)) not in ran] + results
    summary.write_text(json.dumps(merged, indent=2) + "\n")
    (OUT / "summary.md").write_text(markdown(merged))
    print(markdown(results))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
