"""`difftest fix CASE [CASE ...] --engines NAME [--no-verify] [--force]`: the smallest draft-config edit that
makes one engine version feed the draft what training fed, written as a file the user applies, then
verified on the real engine.

1. The engine's layer-id rule (difftest.rules.layer_rules) is solved backwards for the case's training
   wiring: which ids, written where, make that engine feed it.
2. Written to REPORT_DIR/fix/: CASE.NAME.patch.json (a JSON merge patch for the draft's
   config.json) and CASE.NAME.yaml (the case with the patch as that engine's
   `draft_config_overrides`, runnable as is).
3. Verified: `pytest CASE.NAME.yaml [...] --engines=REFERENCE,NAME` in a subprocess, the real engine
   under the patch; every check of that engine must pass. Several cases are verified in that one
   run: one engine session serves them all (an engine start is most of a verification on CPU).
   The verified run's report is REPORT_DIR/fix/verified/CASE_fix_NAME.json.

The draft flags (norm_before_fc, fc_norm, ...) are read through the rules of the release the engine
runs (difftest.rules.engine_releases: the interpreter's environment says which, else a label that is a
release): a flag it reads from another place than training wrote it is written there too.

Where no config can do it (an engine that cannot capture a layer training used, ids not in layer
order, a release that reads a trained flag from no place at all), it says so, names the engines or
releases that can serve the draft as trained, and the wiring to retrain on (or the flag to train
without) for this one. A case that is bad input is named in one line and the
others still run. Exit status: 0 every case fixed and verified (or, with --no-verify, computed),
1 a case has no config fix or failed its verification, 2 a case was bad input, 4 (usage) a path it
would write is refused before any case is computed: --out not a writable folder, or a file an earlier
fix of the case wrote (--force replaces them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from packaging.version import InvalidVersion, Version
from safetensors import safe_open
from safetensors.torch import save_file

from difftest.base.cli_args import deprecated_alias
from difftest.base.exit_codes import TROUBLE, USAGE
from difftest.base.errors import ConfigError, DifftestError
from difftest.base.outputs import atomic_write, check_output_dir, check_output_file
from difftest.base.registry import calibration_engine
from difftest.case.case import expand_vars, load_case
from difftest.checks.layer_reading import engine_view
from difftest.checks.lint import trained_wiring
from difftest.records import Report
from difftest.rules.draft_rules import ENGINES as DRAFT_RULES
from difftest.rules.engine_releases import SUPPORTED, engine_draft_rules, on_record, unrecorded
from difftest.rules.engine_releases import release as release_of
from difftest.rules.layer_rules import spec_variant
from difftest.rules.lint_checkpoint import flag_misreadings
from difftest.rules.overlay import deep_merge
from difftest.run.case_run import CaseRun
from difftest.run.engine import EngineSpec, parse_spec
from difftest.run.envs import list_envs
from difftest.run.pool import EnginePool, Options

HELP = "compute, write and verify the draft-config edit that makes ENGINE feed what training fed"


def add_parser(sub) -> None:
    p = sub.add_parser("fix", help=HELP)
    p.add_argument(
        "cases",
        nargs="+",
        metavar="case",
        help="a case YAML file; several are fixed in turn and verified in one run of the engine",
    )
    p.add_argument(
        "--engines",
        dest="engine",
        default=None,
        metavar="ENGINE",
        help="the one engine to fix for: vllm or sglang (a labelled spec NAME@LABEL works); required",
    )
    deprecated_alias(p, ["--engine"], "--engines", "engine")
    p.add_argument("--out", dest="report_dir", default="reports", help="where fix/ is written (default: reports)")
    deprecated_alias(p, ["--report-dir"], "--out", "report_dir")
    p.add_argument(
        "--reference",
        default=None,
        help="the reference engine of the verifying run (default: the engine that calibrates, ref)",
    )
    p.add_argument(
        "--engine-python",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="as for `difftest run`: the engine's interpreter",
    )
    p.add_argument("--no-verify", action="store_true", help="write the edit without running the engine")
    p.add_argument("--force", action="store_true", help="replace the files an earlier fix of the same case wrote")
    p.add_argument("--engine-timeout", type=int, default=900, help="seconds for the verifying run's engine requests")
    p.add_argument(
        "--no-capture-cache",
        action="store_true",
        help="as for `difftest run`: the verifying run recaptures instead of reusing a cached capture",
    )
    p.set_defaults(handler=run)


@dataclasses.dataclass
class FixResult:
    case: str
    engine: str
    rule: str
    trained: list[int] | None
    before: str
    patch: dict | None
    ids: list[int] | None
    impossible: str | None
    alternatives: list[str]
    side_effects: list[str]
    files: list[str]
    fc_order: list[int] | None = None
    verified: bool | None = None  # None: not run
    verification: list[dict] = dataclasses.field(default_factory=list)
    verification_report: str | None = None

    def lines(self) -> list[str]:
        out = [f"{self.case} on {self.engine}: {self.before}"]
        if self.impossible:
            out.append(f"no config fix: {self.impossible}")
            out += [f"  {a}" for a in self.alternatives]
            return out
        if not self.patch:
            out.append("nothing to fix: the engine already feeds what training fed")
        else:
            if self.fc_order:
                out.append(
                    f"checkpoint edit: fc.weight's input blocks reordered into layer order (new block j = "
                    f"trained block {self.fc_order}[j]): the same function, fed in the order the engine feeds"
                )
            out.append(f"edit: {json.dumps(self.patch)} (merge into the draft's config.json)")
        out += [f"note: {s}" for s in self.side_effects]
        out += [f"wrote {f}" for f in self.files]
        if self.verified is None:
            out.append("not verified (--no-verify)")
        else:
            word = "VERIFIED" if self.verified else "NOT VERIFIED"
            out.append(
                f"{word} on the real engine: " + ", ".join(f"{c['check']} {c['outcome']}" for c in self.verification)
            )
            if self.verification_report:
                out.append(f"verified run: {self.verification_report}")
        return out


def engine_release(spec: EngineSpec, engine_python: list[str]) -> str | None:
    """The release the verifying run will start for `spec`, read without starting it: the engine's
    distribution in the environment of the interpreter it would run on (difftest.run.envs), else a
    label that is a release (NAME@0.5.16). None: unknown, the pinned release's rules apply."""
    pythons = dict(e.split("=", 1) for e in engine_python if "=" in e)  # a malformed one: the verifying run names it
    options = Options(engines=[spec], reference=EngineSpec(calibration_engine()), engine_python=pythons)
    python = EnginePool(options).python_for(spec)
    # the environment is the interpreter's folder's parent, its links kept: a venv's python links to the
    # system's, which every environment shares
    env = Path(python).parent.parent.resolve()
    found = next((e.release for e in list_envs(sized=False) if Path(e.path).resolve() == env), None)
    if found:
        return release_of(found)
    try:
        return str(Version(spec.label)) if spec.label else None
    except InvalidVersion:
        return None


def compute(case_path: Path, engine: str, out_dir: Path, version: str | None = None) -> tuple[FixResult, Path | None]:
    """The edit and its files (no engine run). Returns the result and the patched case's path.
    `version`: the engine release it is computed for (engine_release; None: the pinned one)."""
    spec = parse_spec(engine)
    case = load_case(case_path)
    pool = EnginePool(Options(engines=[spec], reference=EngineSpec(calibration_engine())))
    prepared = CaseRun(pool, case).engine_case(spec)
    trained = trained_wiring(prepared)
    notes = []
    if version is not None and not on_record(spec.name, version):
        if spec.name in SUPPORTED:
            notes.append(unrecorded(spec.name, version) + "; this edit follows the pinned release's rules")
        version = None

    view = engine_view(
        prepared, spec.name, trained, version=version, variant=spec_variant(spec.name, dict(spec.params), version)
    )
    if view is None:
        raise ConfigError(
            f"--engines {engine}: no layer-id rule models {spec.name} on this target "
            "(difftest.rules.layer_rules knows vllm and sglang on Llama, Qwen3 and DeepSeek-V3 targets)"
        )
    edit = view.edit()
    if view.trained is None or edit is None:
        raise ConfigError(
            f"{case_path}: the training wiring {trained} is not a list of target hidden states; "
            "a layer-id edit cannot express it"
        )
    before = view.reading.explain() + f"; training fed [{', '.join(f'h{k}' for k in view.trained)}]"
    result = FixResult(
        case.name,
        spec.id,
        view.rule.words(),
        view.trained,
        before,
        edit.patch if edit.possible else None,
        edit.ids,
        edit.impossible,
        edit.alternatives,
        [*edit.side_effects, *notes],
        [],
        edit.fc_order,
    )
    if not edit.possible:
        return result, None
    # The draft flags the engine's release reads otherwise than training meant (the release rules,
    # difftest.rules.engine_releases): written where it reads them, or, where it reads them from no place
    # this config has, no config fix at all (the layer ids alone would be verified and fail).
    rules = engine_draft_rules(spec.name, version) if spec.name in DRAFT_RULES else None
    misread = flag_misreadings(view.draft_config, [rules]) if rules is not None else []
    blocked = [m for m in misread if m.cannot() is not None]
    if blocked:
        result.patch = None
        result.impossible = "; ".join(str(m.cannot()) for m in blocked)
        result.alternatives = [a for m in blocked for a in m.alternatives()]
        return result, None
    # already fed as trained: no layer ids to set
    patch = {} if view.reading.fed == view.trained and view.reading.refusal is None else edit.patch
    for m in misread:
        patch = deep_merge(patch, m.patch() or {})
        result.side_effects.append(
            f"{m.flag}: {m.meant!r} written at {m.place()}, where {m.rules.engine} {m.rules.version} reads it "
            f"(as given, it runs the draft with {m.flag}={bool(m.got)})"
        )
    result.patch = patch
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{case.name}.{spec.key}"
    patch_file = out_dir / f"{stem}.patch.json"
    atomic_write(patch_file, json.dumps(result.patch, indent=1) + "\n")
    raw = yaml.safe_load(Path(case_path).read_text())
    carry_paths(raw, Path(case_path), out_dir)  # before the fc edit below points draft at its own copy
    if raw.get("wiring") == "infer":  # what was inferred is what the fix was computed for: pin it
        raw["wiring"] = [f"h{k}" for k in view.trained]
    if edit.fc_order:
        # the checkpoint edit: the same draft with fc's input blocks in layer order, for every engine
        # (the reference included: the patched case's wiring is the layer-ordered feed)
        edited = write_reordered_draft(Path(prepared.draft), edit.fc_order, out_dir / f"{stem}.draft")
        raw["draft"] = os.path.relpath(edited, out_dir)  # beside the patched case, which moves with it
        raw["wiring"] = [f"h{k}" for k in edit.feeds]
        result.files.append(str(edited))
    section = dict((raw.get("engines") or {}).get(spec.key) or {})
    section["draft_config_overrides"] = deep_merge(section.get("draft_config_overrides") or {}, patch)
    raw.setdefault("engines", {})[spec.key] = section
    raw["name"] = f"{case.name}_fix_{spec.key.replace('@', '_')}"
    raw.pop("expect_failure", None)  # the fixed case must pass on this engine with no excuse declared
    case_file = out_dir / f"{stem}.yaml"
    atomic_write(
        case_file,
        f"# written by `difftest fix {case_path} --engines {engine}`\n" + yaml.safe_dump(raw, sort_keys=False),
    )
    result.files = [str(patch_file), str(case_file), *result.files]
    return result, case_file


def carry_paths(raw: dict, case_path: Path, out_dir: Path) -> None:
    """The raw case's file paths (target, draft, prompt files), as the user wrote them, made to mean the
    same from `out_dir`, where the patched case is written: a fixture and an absolute path unchanged,
    ${VAR} kept as written (it is the user's way to say where models live), a relative path re-rooted
    on `out_dir`. The computation read the case through load_case, which expands and resolves; this
    only decides what the written case says."""
    for field in ("target", "draft"):
        value = raw.get(field)
        if isinstance(value, str):
            raw[field] = _carried(value, case_path, out_dir, field, expand_home=False)
    for where, section in (("prompts", raw), ("speculative.prompts", raw.get("speculative"))):
        spec = section.get("prompts") if isinstance(section, dict) else None
        if isinstance(spec, dict) and isinstance(spec.get("file"), str):
            spec["file"] = _carried(spec["file"], case_path, out_dir, f"{where}.file", expand_home=True)


def _carried(value: str, case_path: Path, out_dir: Path, where: str, expand_home: bool) -> str:
    """`value`, a path relative to `case_path`'s folder unless absolute, as it reads from `out_dir`.
    `expand_home`: the field reads ~ as the home folder (prompt files do; checkpoint paths do not)."""
    if value.startswith("fixture:"):
        return value
    meant = expand_vars(value, case_path, where) if "${" in value else value
    if (Path(meant).expanduser() if expand_home else Path(meant)).is_absolute():
        return value
    case_dir, here = case_path.parent.resolve(), out_dir.resolve()
    if "${" in value:  # relative once expanded: the variable stays, led by the way back to the case's folder
        back = os.path.relpath(case_dir, here)
        return value if back == "." else f"{Path(back).as_posix()}/{value}"
    # normalised without resolving the path itself: a symlink the user named (models/current) stays one
    return Path(os.path.relpath(os.path.normpath(case_dir / value), here)).as_posix()


def write_reordered_draft(draft: Path, order: list[int], out: Path) -> Path:
    """A copy of `draft` (other files linked) whose fc.weight input blocks are reordered: new block j
    = old block order[j]. With its fc fed cat(x[order[0]], x[order[1]], ...) it computes exactly what
    the original computed on cat(x[0], x[1], ...). Written beside, then renamed into place."""
    holder = None
    for f in sorted(draft.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            key = next((k for k in h.keys() if k.removeprefix("model.") == "fc.weight"), None)
            if key is not None:
                holder, metadata = (f, key), h.metadata()
                tensors = {k: h.get_tensor(k) for k in h.keys()}
                break
    if holder is None:
        raise ConfigError(f"{draft}: no fc.weight in its safetensors files; cannot reorder fc's input blocks")
    f, key = holder
    w = tensors[key]
    if w.shape[1] % len(order):
        raise ConfigError(f"{draft}: fc.weight has {w.shape[1]} inputs, not a multiple of {len(order)} blocks")
    size = w.shape[1] // len(order)
    tensors[key] = torch.cat([w[:, j * size : (j + 1) * size] for j in order], dim=1).contiguous()
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for other in draft.iterdir():
            if other != f:
                (tmp / other.name).symlink_to(other.resolve())
        save_file(tensors, str(tmp / f.name), metadata=metadata)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def verify(fixed: list[tuple[FixResult, Path]], args: argparse.Namespace, out_dir: Path) -> None:
    """The patched cases on the real engine, in one run: every check of that engine must pass."""
    reference = args.reference or calibration_engine()
    report_dir = out_dir / "verified"
    engine = fixed[0][0].engine
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "difftest.plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfEs",
        "--rootdir",
        str(out_dir),
        "-c",
        "/dev/null",
        *(str(case_file) for _, case_file in fixed),
        f"--engines={reference},{engine}",
        "--require-engines",
        f"--out={report_dir}",
        f"--engine-timeout={args.engine_timeout}",
        *(f"--engine-python={e}" for e in args.engine_python),
        *(["--no-capture-cache"] if args.no_capture_cache else []),
    ]
    print(f"[difftest fix] verifying on the real engine: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for result, case_file in fixed:
        report = report_dir / f"{yaml.safe_load(case_file.read_text())['name']}.json"
        if not report.exists():
            result.verified = False
            result.verification = [
                {"check": "run", "outcome": f"no report (exit {proc.returncode}): {proc.stdout[-300:]}"}
            ]
            continue
        checks = Report.load(report).results(result.engine)
        result.verification = [
            {"check": c.check, "outcome": c.outcome, "message": c.message.splitlines()[0] if c.message else ""}
            for c in checks
        ]
        result.verified = bool(checks) and all(c.outcome == "passed" for c in checks)
        result.verification_report = str(report)


def _case_name(path: Path) -> str | None:
    """The case's name, read ahead of its fix; None where the file cannot say (compute names why)."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    if not isinstance(raw, dict):
        return None
    name = raw.get("name") or path.stem  # the case's own default (difftest.case.case)
    return name if isinstance(name, str) else None


def check_outputs(args: argparse.Namespace, out_dir: Path) -> None:
    """Every path the run will write, checked before any case is read into an engine's rules or an
    engine starts (ConfigError in one line naming --out): the folder can be made and written, no file
    is a directory, and none an earlier fix wrote is replaced without --force."""
    check_output_dir(out_dir, "--out")
    try:
        key = parse_spec(args.engine).key
    except DifftestError:
        return  # compute names the bad spec, case by case
    for case in args.cases:
        name = _case_name(Path(case))
        if name is None:
            continue  # compute names why the case cannot be read
        stem = f"{name}.{key}"
        files = [out_dir / f"{stem}.patch.json", out_dir / f"{stem}.yaml", out_dir / f"{stem}.fix.json"]
        if not args.no_verify:
            files.append(out_dir / "verified" / f"{name}_fix_{key.replace('@', '_')}.json")
        for path in files:
            check_output_file(path, "--out")
        draft = out_dir / f"{stem}.draft"  # written only for an fc reorder; an old one is replaced then
        if draft.exists() and not draft.is_dir():
            raise ConfigError(f"--out: {draft} is not a directory (the reordered draft goes there)")
        old = next((p for p in [*files, draft] if p.exists()), None)
        if old is not None and not args.force:
            raise ConfigError(f"--out: {old} already exists, from an earlier fix (--force replaces it)")


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "engine", None):  # required, under either spelling (--engine warns)
        print("difftest fix: --engines ENGINE is required (the one engine to fix for)", file=sys.stderr)
        return USAGE
    out_dir = Path(args.report_dir) / "fix"
    try:
        check_outputs(args, out_dir)
    except ConfigError as e:
        print(f"difftest fix: {e}", file=sys.stderr)
        return USAGE
    try:
        version = engine_release(parse_spec(args.engine), args.engine_python)
    except DifftestError:
        version = None  # compute names the bad spec, case by case
    results: list[FixResult] = []
    fixed: list[tuple[FixResult, Path]] = []  # the patched cases the engine verifies
    bad_input = False
    first_with_name: dict[str, str] = {}
    for case in args.cases:
        name = _case_name(Path(case))
        if name is not None and name in first_with_name:
            # its files are named after the case: the second would overwrite the first's
            print(
                f"difftest fix: {case}: a case named {name!r} is already being fixed ({first_with_name[name]}); "
                "one case of a name per run",
                file=sys.stderr,
            )
            bad_input = True
            continue
        if name is not None:
            first_with_name[name] = case
        try:
            result, case_file = compute(Path(case), args.engine, out_dir, version)
        except DifftestError as e:
            print(f"difftest fix: {e}", file=sys.stderr)
            bad_input = True
            continue
        except (OSError, ValueError, KeyError) as e:  # unreadable files, bad YAML: one line, no traceback
            print(f"difftest fix: {case}: {type(e).__name__}: {e}", file=sys.stderr)
            bad_input = True
            continue
        results.append(result)
        if case_file is not None:
            fixed.append((result, case_file))
    if fixed and not args.no_verify:
        try:
            verify(fixed, args, out_dir)
        except (DifftestError, OSError, ValueError, KeyError) as e:  # a patched case or report unreadable
            print(f"difftest fix: verifying: {type(e).__name__}: {e}", file=sys.stderr)
            return TROUBLE
    for i, result in enumerate(results):
        if i:
            print()
        for line in result.lines():
            print(line)
        if result.files:
            atomic_write(
                out_dir / f"{Path(result.files[0]).name.removesuffix('.patch.json')}.fix.json",
                json.dumps(dataclasses.asdict(result), indent=1) + "\n",
            )
    if bad_input:
        return TROUBLE
    return 1 if any(r.impossible or r.verified is False for r in results) else 0
