"""`difftest preview vllm==0.34.0 CASE...`: what a vLLM release that cannot run here (a CUDA-only build:
0.33.0, 0.34.0) will feed each case's draft, answered by that release's own config code.

The release's wheel is downloaded once (`pip download --no-deps`) and its Python sources unpacked into
`${DIFFTEST_CACHE}/releases/vllm-X/` (written whole, then renamed); difftest_engines/vllm/release_probe.py then
imports that tree instead of the installed vllm, under vLLM's CPU interpreter, and calls the release's
functions on each case's draft and target configs: the aux-layer resolution of each runner it has,
its defaults, whether it feeds aux hidden states at all, and its draft-length rule. The installed
(pinned) release answers the same questions with its own code, side by side. What reaches fc is then
the rule data's capture of those ids (difftest layer_rule: vLLM captures id k as h[k], in layer
order), against what training fed. Exit status: 0 when the release feeds every case as trained on its
default runner, 1 when it does not, 2 when it could not answer (a case file missing, vLLM not set up,
its wheel or config code unusable), 4 for a bad argument (not vllm==VERSION, an --engine-python that
is not there): difftest.base.exit_codes, one line each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from difftest.api import Command, ConfigError, DifftestError, TROUBLE, USAGE
from difftest.api import cache_root, declared_ids, hidden_index, layer_rule, load_case, overlay_checkpoint
from difftest.api import read_json, resolve, resolve_fixture, target_family

PROJECT_ROOT = Path(__file__).resolve().parents[2]
COMPLETE = ".complete"


@dataclass
class RunnerReading:
    release: str
    runner: str
    ids: list[int] | None  # what the release's own code read (None: no ids found)
    source: str
    defaults: list[int]
    fed: list[int] | None  # h indices reaching fc; None: the runner does not feed aux states
    uses_aux: bool = True
    note: str = ""

    def words(self) -> str:
        head = f"vllm {self.release} runner {self.runner}"
        if not self.uses_aux:
            return f"{head}: use_aux_hidden_state is false: the last hidden state alone, no fc ({self.note})"
        how = (
            f"ids {self.ids} ({self.source})" if self.ids else f"no ids ({self.source}) -> its defaults {self.defaults}"
        )
        return f"{head}: {how} -> feeds [{', '.join(f'h{k}' for k in self.fed or [])}]"


@dataclass
class CasePreview:
    case: str
    trained: list[int] | None
    readings: list[RunnerReading] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    error: str | None = None
    flags: dict[str, str] = field(default_factory=dict)  # release -> its flags line


def release_root(version: str, python: str, log=print) -> Path:
    """The release's Python sources, unpacked once per cache (ConfigError in one line when the wheel
    cannot be had or read)."""
    root = cache_root() / "releases" / f"vllm-{version}"
    if (root / COMPLETE).is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".vllm-{version}.", dir=root.parent))
    try:
        log(f"[difftest preview] downloading vllm {version}'s wheel (no dependencies)")
        got = subprocess.run(
            [
                python,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                f"vllm=={version}",
                "-d",
                str(work / "wheel"),
            ],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        wheels = sorted((work / "wheel").glob("vllm-*.whl")) if got.returncode == 0 else []
        if not wheels:
            last = (got.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ConfigError(f"difftest preview: vllm {version}: no wheel could be downloaded ({last[:300]})")
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                z.extractall(
                    work / "src", [n for n in z.namelist() if n.startswith("vllm/") and n.endswith((".py", ".json"))]
                )
        except (zipfile.BadZipFile, OSError) as e:
            raise ConfigError(f"difftest preview: {wheels[0].name} cannot be read ({e})") from None
        shutil.rmtree(work / "wheel")
        (work / "src" / COMPLETE).write_text(wheels[0].name + "\n")
        try:
            os.rename(work / "src", root)
        except OSError:  # another process unpacked it first
            if not (root / COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root


def probe(python: str, pairs: list[dict], root: Path | None) -> dict:
    """difftest_engines/vllm/release_probe.py over every (target, draft) pair, in one process."""
    args = [python, "-m", "difftest_engines.vllm.release_probe"] + (["--release-root", str(root)] if root else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(args, input=json.dumps(pairs), capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0 or not done.stdout.strip():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(
            f"difftest preview: the config code of {'vllm at ' + str(root) if root else 'the installed vllm'} "
            f"could not run here ({last[:300]})"
        )
    return json.loads(done.stdout)


def _path(ref: str) -> str:
    return resolve_fixture(ref) if ref.startswith("fixture:") else ref


def _readings(raw: dict, version: str, family: str) -> list[RunnerReading]:
    out = []
    defaults = (raw.get("defaults") or {}).get("value") or []
    L = int(raw["num_layers"])
    uses = raw.get("uses_aux_v2", {})
    for runner in ("v1", "v2"):
        got = raw.get(f"ids_{runner}") or {}
        if "absent" in got:
            continue
        if "error" in got:
            out.append(
                RunnerReading(version, runner, None, got["source"], defaults, None, note=f"failed: {got['error']}")
            )
            continue
        ids = got.get("value")
        rule = layer_rule("vllm", family, None, f"runner {runner}")
        fed = rule.predict_ids(ids or defaults, L).fed if rule is not None else None
        src = got["source"]
        reading = RunnerReading(version, runner, ids, src, defaults, fed)
        if runner == "v2" and uses.get("value") is False:
            reading.uses_aux, reading.note = False, uses["source"]
        out.append(reading)
    return out


def preview_cases(version: str, cases: list[Path], python: str, log=print) -> tuple[list[CasePreview], str]:
    root = release_root(version, python, log)
    previews, pairs, families = [], [], []
    for path in cases:
        try:
            case = load_case(path)
            target, draft = _path(case.target), _path(case.draft)
            overrides = (case.engines.get("vllm") or {}).get("draft_config_overrides") or {}
            if overrides:
                draft = str(overlay_checkpoint(draft, overrides, cache_root() / "vllm"))
            tcfg = read_json(Path(target) / "config.json", "target config")
            text = tcfg.get("text_config", tcfg)
            dcfg = read_json(Path(draft) / "config.json", "draft config")
            trained = None
            if case.wiring != "infer":
                w = resolve(
                    case.wiring,
                    int(text["num_hidden_layers"]),
                    case.layer_ids or declared_ids(dcfg),
                    where=f"{path}: wiring",
                )
                ks = [hidden_index(n) for n in w.inputs]
                trained = None if None in ks else [int(k) for k in ks if k is not None]
        except DifftestError as e:
            previews.append(CasePreview(str(path), None, error=str(e)))
            continue
        previews.append(CasePreview(case.name, trained))
        pairs.append({"target": target, "draft": draft})
        families.append(target_family(tcfg))
    live = [p for p in previews if p.error is None]
    pinned = probe(python, pairs, None) if pairs else {"readings": [], "version": "?"}
    new = probe(python, pairs, root) if pairs else {"readings": [], "version": version}
    for p, fam, a, b in zip(live, families, pinned["readings"], new["readings"]):
        for raw, label in ((a, pinned["version"]), (b, new["version"])):
            if "error" in raw:
                p.lines.append(f"vllm {label}: its config code failed on this case: {raw['error']}")
                continue
            p.readings += _readings(raw, label, fam)
            flags = raw.get("flags", {}).get("value") or {}
            if flags:
                shown = "; ".join(
                    f"{k}: " + ", ".join(f"{w} {v}" for w, v in where.items() if v is not None)
                    for k, where in flags.items()
                )
                p.flags[label] = (
                    f"vllm {label}: draft flags after its config loading: {shown} ({raw['flags']['source']})"
                )
            length = raw.get("draft_length", {}).get("value")
            if length and length.get("draft") != length.get("after"):
                p.lines.append(
                    f"vllm {label}: the draft's max_position_embeddings {length['draft']} -> {length['after']} "
                    f"({raw['draft_length']['source']})"
                )
            elif length and length.get("draft") and length["draft"] < length["target"]:
                p.lines.append(
                    f"vllm {label}: the draft keeps max_position_embeddings {length['draft']} (target "
                    f"{length['target']}): its rope caps the served length ({raw['draft_length']['source']})"
                )
    return previews, new.get("version", version)


def render(previews: list[CasePreview], version: str) -> tuple[list[str], bool]:
    """Lines to print, and whether the release feeds every case as trained on its default runner (V2)."""
    lines, fine = [], True
    for p in previews:
        if p.error:
            lines.append(f"{p.case}: {p.error}")
            continue
        trained = "?" if p.trained is None else "[" + ", ".join(f"h{k}" for k in p.trained) + "]"
        lines.append(f"{p.case}: training fed {trained}")
        for r in p.readings:
            mark = ""
            if p.trained is not None and r.uses_aux and r.fed is not None:
                mark = "  (as trained)" if r.fed == p.trained else "  DIFFERS from training"
            elif not r.uses_aux:
                mark = "  DIFFERS from training"
            lines.append(f"  {r.words()}{mark}")
            if r.release == version and r.runner == "v2" and mark.strip().startswith("DIFFERS"):
                fine = False
        lines += [f"  {line}" for line in p.lines]
        values = list(p.flags.values())
        if values and len({v.split(": ", 1)[1] for v in values}) > 1:  # the releases load the flags differently
            lines += [f"  {v}" for v in values]
        elif values:
            lines.append(f"  {values[-1].replace(f'vllm {version}:', 'both releases:', 1)}")
    return lines, fine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "release", help="a vLLM release, vllm==X (e.g. vllm==0.34.0): its wheel's config code is run, not its engine"
    )
    p.add_argument("cases", nargs="+", type=Path, help="case YAML files")
    p.add_argument(
        "--engine-python", help="vLLM's interpreter (default: the environment scripts/setup-engine vllm built)"
    )


def main(args: argparse.Namespace) -> int:
    m = re.fullmatch(r"vllm==(\d+(?:\.\d+){1,3}(?:[.-]?\w+)?)", args.release.strip())
    if m is None:
        print(f"difftest preview: {args.release!r}: expected vllm==VERSION, e.g. vllm==0.34.0", file=sys.stderr)
        return USAGE
    if args.engine_python is not None and not Path(args.engine_python).is_file():  # as run's --engine-python
        print(f"difftest preview: --engine-python: {args.engine_python}: no such file", file=sys.stderr)
        return USAGE
    python = args.engine_python or str(cache_root() / "envs" / "vllm" / "bin" / "python")
    if not Path(python).exists():
        print(
            f"difftest preview: vLLM's interpreter {python} not found; set it up with: scripts/setup-engine vllm",
            file=sys.stderr,
        )
        return TROUBLE
    missing = next((c for c in args.cases if not c.is_file()), None)
    if missing is not None:  # before the release's wheel is downloaded, not one line among the previews after
        print(f"difftest preview: {missing}: no such case file", file=sys.stderr)
        return TROUBLE
    try:
        previews, version = preview_cases(m.group(1), args.cases, python, log=lambda s: print(s, file=sys.stderr))
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return TROUBLE
    lines, fine = render(previews, version)
    print(
        f"vllm {version} preview: its own config code (unpacked from its wheel) on {len(previews)} case(s); "
        "the pinned release beside it"
    )
    print("\n".join(lines))
    return 0 if fine and not any(p.error for p in previews) else 1


PREVIEW = Command(
    "preview",
    "what a vLLM release that cannot run here (e.g. vllm==0.34.0) will feed each case's draft, "
    "from that release's own config code",
    add_arguments,
    main,
)
