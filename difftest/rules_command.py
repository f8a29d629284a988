"""`difftest rules discover ENGINE[@LABEL]`: an engine release's layer-id rule, measured (difftest.run.
discover_rules), written as JSON a reviewer can read and compared with the nearest rule on record."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from difftest.base import exit_codes
from difftest.base.errors import ConfigError, DifftestError
from difftest.base.outputs import atomic_write
from difftest.base.registry import registered_engines
from difftest.base.settings import unknown_key
from difftest.rules import engine_releases
from difftest.rules.layer_rules import target_family
from difftest.run.discover_rules import difference, discover
from difftest.run.engine import EngineSpec, parse_spec
from difftest.run.case_run import resolve_fixture
from difftest.rules.layer_rules import spec_variant


def add_parser(sub) -> None:
    r = sub.add_parser("rules", help="engine rules as data: measure an engine release's layer-id rule")
    rsub = r.add_subparsers(dest="rules_command", required=True)
    d = rsub.add_parser(
        "discover", help="probe ENGINE[@LABEL] with designed draft configs and write the rule it follows"
    )
    d.add_argument(
        "engine", help="an engine spec: vllm, vllm[runner=v1], sglang@0.5.24 (its environment: difftest env create)"
    )
    d.add_argument(
        "--target",
        default="fixture:tiny-llama",
        help="a Llama-family target of 6+ layers (default: fixture:tiny-llama)",
    )
    d.add_argument("--draft", default="fixture:tiny-llama-eagle3", help="an EAGLE-3 draft of it with a 3-chunk fc")
    d.add_argument(
        "--against",
        default=None,
        metavar="VERSION",
        help="the rule on record to compare with (default: the release the engine reports, else the pinned one)",
    )
    d.add_argument("--out", type=Path, default=Path("reports") / "rules", help="where the rule's JSON is written")
    d.add_argument("--engine-python", action="append", default=[], metavar="NAME=PATH", help="as for `difftest run`")
    d.add_argument("--engine-timeout", type=float, default=900.0, help="seconds per engine request")
    d.set_defaults(handler=main)


def _arguments(args: argparse.Namespace) -> tuple[EngineSpec, dict[str, str]]:
    """The engine spec and --engine-python's interpreters; ConfigError in one line naming the bad one."""
    spec = parse_spec(args.engine)
    engines = registered_engines()
    if spec.name not in engines:
        raise unknown_key("engine", spec.name, engines, "engine")
    bad = [p for p in args.engine_python if "=" not in p]
    if bad:
        raise ConfigError(f"--engine-python: {bad[0]!r} is not NAME=PATH")
    return spec, dict(p.split("=", 1) for p in args.engine_python)


def main(args: argparse.Namespace) -> int:
    try:
        spec, pythons = _arguments(args)
    except ConfigError as e:  # a bad argument value: a usage error, as the parser's own
        print(f"difftest rules discover: {e}", file=sys.stderr)
        return exit_codes.USAGE
    try:  # from here on the command could not answer (an unreadable model, the engine failed)
        target = resolve_fixture(args.target) if args.target.startswith("fixture:") else args.target
        draft = resolve_fixture(args.draft) if args.draft.startswith("fixture:") else args.draft
        with tempfile.TemporaryDirectory(prefix="difftest-rules-") as work:
            found = discover(
                spec,
                target,
                draft,
                Path(work),
                pythons,
                args.engine_timeout,
                progress=lambda s: print(s, file=sys.stderr, flush=True),
            )
        family = target_family(json.loads((Path(target) / "config.json").read_text()))
        version = args.against or (found.release if engine_releases.on_record(spec.name, found.release) else None)
        known = engine_releases.layer_rule(
            spec.name, family, version, found.variant or spec_variant(spec.name, dict(spec.params), version)
        )
    except DifftestError as e:
        print(f"difftest rules discover: {e}", file=sys.stderr)
        return exit_codes.TROUBLE
    out = args.out / f"{spec.id.replace('/', '_')}.json"
    diff = difference(found, known) if known is not None else None
    record = {**found.to_dict(), "compared_with": known.label if known else None, "differences": diff}
    atomic_write(out, json.dumps(record, indent=1))
    print(
        f"{spec.id} ({found.release}{', ' + found.variant if found.variant else ''}): ids from "
        f"{' then '.join(found.ids_from) or 'nowhere'}, id k -> h[k{found.shift:+d}]"
        if found.shift is not None
        else f"{spec.id}: the shift could not be measured"
    )
    print(
        f"  fed in layer order: {found.sorted_by_layer}; no ids: {found.defaults} ({found.defaults_formula or 'no known formula'})"
    )
    for u in found.unresolved:
        print(f"  unresolved: {u}")
    if known is None:
        print("  no rule on record to compare with")
    elif diff:
        print(f"  differs from {known.label}:")
        print("\n".join(f"    {d}" for d in diff))
    else:
        print(f"  the same rule as {known.label} (over the places probed)")
    print(f"wrote {out}")
    return 0
