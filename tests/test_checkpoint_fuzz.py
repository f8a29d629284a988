"""Checkpoint fuzz, generated: mutants of real checkpoints, run as a user runs them on the reference.

For each target family (Llama, Qwen3, DeepSeek-V3) with an EAGLE-3 Llama-style draft, and for the
MLA draft over DeepSeek-V3, tests/checkpoint_mutants.py enumerates every mutant of the target's and
the draft's checkpoints from the files themselves (every tensor dropped, truncated, grown,
transposed, NaN-filled; every config.json key missing and mistyped). Each sampled mutant becomes a
case file, and all of a pair's run in one `difftest run cases/ --engines=ref` (the user's command;
one reference worker for the lot, each case's models loaded fresh). Each mutant's outcome, read from
the run's report (a case that does not load: the JUnit XML), is one class:

  refused-named      an item errs with one line that names the tensor or key (good)
  verdict-named      a check fails, and a line it adds to the pristine case's messages names the
                     tensor or key (good: the lint's findings)
  warned-named       every check passes, and a line a check adds names it (good: a lint warning)
  optional           every check passes, and the key is genuinely optional (OPTIONAL, each with why)
  known              bad, and being fixed under issue 45 item 8 (KNOWN)
  open               bad, and listed as an open finding of this fuzz (OPEN, each with what a user meets)
  refused-unnamed    an item errs or fails without naming it, over several lines, or with a traceback (bad)
  accepted-silently  every check passes and nothing says so, nor that it may (bad)

The test asserts no bad class outside KNOWN and OPEN, prints the counts by class per pair
(`pytest -s`), and writes them with the seed and every known, open and bad mutant to
reports/checkpoint-fuzz.txt. A message "names" a tensor by its stored name (or without `model.`),
a key by its last part (rope_theta of rope_parameters.rope_theta).

Cost: CI runs DIFFTEST_FUZZ_PER_KIND mutants (default 2) of each (side, mutation kind) per pair,
drawn with a seed printed per run (DIFFTEST_FUZZ_SEED=N replays one); every kind appears for every
pair: 126 mutants, 50 s on an idle two-core machine (4 to 5 minutes when other runs share its cores).
DIFFTEST_FUZZ_PER_KIND=0 runs every mutant (2,484: 6 minutes idle).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

import checkpoint_mutants as cm
from helpers import ROOT, TESTS, fixture_path

SEED = int(os.environ.get("DIFFTEST_FUZZ_SEED") or random.SystemRandom().randrange(2**31))
PER_KIND = int(os.environ.get("DIFFTEST_FUZZ_PER_KIND", "2"))
REPORT = ROOT / "reports" / "checkpoint-fuzz.txt"

GOOD = ("refused-named", "verdict-named", "warned-named", "optional")
BAD = ("refused-unnamed", "accepted-silently")


@dataclass(frozen=True)
class Rule:
    """Mutants this rule covers: `side` ("*": either), one of `kinds`, a name `name` fully matches
    (a regex over the tensor's stored name or the dotted config key) and, when given, items whose
    messages `message` is found in (so a rule never hides another failure of the same mutant)."""

    side: str
    kinds: tuple[str, ...]
    name: str
    why: str
    message: str = ""

    def covers(self, m: cm.Mutant, items: list[Item]) -> bool:
        return (
            self.side in ("*", m.side)
            and m.kind in self.kinds
            and re.fullmatch(self.name, m.name) is not None
            and (not self.message or any(re.search(self.message, i.message) for i in items))
        )


CONFIG = cm.CONFIG_KINDS
MISTYPED = ("string-for-number", "number-for-string", "list-for-scalar")

# Keys a run may accept absent or changed, each with why. Absent means transformers' (or the draft
# config's) default applies, and every engine reads the key through the same default.
TENSOR_KINDS = cm.TENSOR_KINDS
TRANSFORMERS_DEFAULT = (
    "absent, transformers' config class default applies, the value this checkpoint has "
    "(every engine reads it through the same class)"
)
OPTIONAL: list[Rule] = [
    Rule(
        "*",
        ("missing",),
        "architectures",
        "the config class comes from model_type (target) or the speculative method (draft)",
    ),
    Rule(
        "target", ("missing",), "attention_bias|mlp_bias|pretraining_tp|hidden_act|rms_norm_eps", TRANSFORMERS_DEFAULT
    ),
    Rule("target", ("missing",), "head_dim", TRANSFORMERS_DEFAULT + ": hidden_size / num_attention_heads"),
    Rule("target", ("missing",), "max_position_embeddings", TRANSFORMERS_DEFAULT + "; no prompt reaches it"),
    Rule(
        "target",
        ("missing",),
        "rope_parameters(\\.rope_theta|\\.rope_type)?",
        TRANSFORMERS_DEFAULT + ": default rope, theta 10000",
    ),
    Rule("target", ("missing",), "tie_word_embeddings", TRANSFORMERS_DEFAULT + ": false, and the lm_head is stored"),
    Rule(
        "target",
        ("missing",),
        "attention_dropout|initializer_range|use_cache",
        "training or generation only: a forward pass never reads it",
    ),
    Rule(
        "target",
        ("missing",),
        "bos_token_id|eos_token_id|pad_token_id",
        "the cases' prompts are token ids: no special token is read",
    ),
    Rule("target", ("list-for-scalar",), "eos_token_id", "a list of eos ids is valid (generation stops at any)"),
    Rule(
        "target",
        ("missing",),
        "layer_types|max_window_layers|sliding_window|use_sliding_window",
        "Qwen3's sliding window: off by default (use_sliding_window false), as this checkpoint has it",
    ),
    Rule(
        "target",
        ("missing",),
        "output_router_logits|num_nextn_predict_layers",
        "DeepSeek-V3's router logits (training only) and multi-token-prediction layers (not in the checkpoint, "
        "never run by a forward pass)",
    ),
    Rule(
        "*",
        ("missing",),
        "dtype|torch_dtype",
        "the case's dtype is what every engine is given; the config's is only a default",
    ),
    Rule("*", CONFIG, "transformers_version", "informational: which transformers wrote the file"),
    Rule("draft", ("missing",), "head_dim", "absent, the draft config's default hidden_size / num_attention_heads"),
    Rule("draft", ("missing",), "hidden_act|rms_norm_eps|max_position_embeddings|attention_bias", TRANSFORMERS_DEFAULT),
    Rule("draft", ("missing",), "target_hidden_size", "absent, the draft's own hidden_size: the target's here"),
    Rule(
        "draft",
        ("missing",),
        "norm_output",
        "absent is false where engines read it (the top level: difftest.rules.draft_rules), as this draft has it",
    ),
    Rule(
        "draft",
        ("missing",),
        "rope_theta|rope_parameters(\\.rope_theta|\\.rope_type)?",
        "either rope_parameters or the top-level rope_theta gives the rope: the other is still there",
    ),
    Rule(
        "draft",
        ("missing",),
        "norm_before_fc|fc_norm",
        "absent is false, and the checkpoint holds no fc-norm weights to read",
    ),
    Rule(
        "draft",
        ("missing",),
        "eagle_aux_hidden_state_layer_ids|eagle_config|eagle_config\\.eagle_aux_hidden_state_layer_ids",
        "the ids are in both places (top level and eagle_config): the other still gives them",
    ),
    Rule(
        "draft",
        ("missing",),
        "eagle_config\\.use_aux_hidden_state",
        "absent is true for an EAGLE-3 draft in every engine",
    ),
    Rule("draft", ("missing",), "model_type", "the draft's class comes from the speculative method, not model_type"),
]

ITEM_8 = "issue 45 item 8"
# Findings of this fuzz another change fixes. KNOWN applies only to a mutant that classifies as bad,
# so a fixed one counts as good at once; each is listed in the report.
KNOWN: list[Rule] = [
    Rule(
        "draft",
        ("string-for-number", "list-for-scalar"),
        "hidden_size|num_attention_heads|num_key_value_heads|head_dim|vocab_size|intermediate_size|draft_vocab_size"
        "|target_hidden_size|num_hidden_layers|rms_norm_eps|rope_theta|rope_parameters\\.rope_theta",
        f"{ITEM_8}: string numbers in the draft config ('128' read as 128; [128] a TypeError naming no key)",
    ),
    Rule("draft", CONFIG, "tie_word_embeddings", f"{ITEM_8}: tie_word_embeddings vs the draft's lm_head"),
    Rule(
        "target",
        ("truncated", "grown", "transposed"),
        ".*",
        f"{ITEM_8}: a wrong-shaped target tensor is refused in transformers' words, naming no tensor",
    ),
]


ITEM_7 = "issue 45 item 7 (open)"
# Findings of this fuzz not fixed yet, each with what a user meets: counted as "open", listed in the
# report. Deleting a rule makes its mutants fail the test again (the way to check a fix).
OPEN: list[Rule] = [
    Rule(
        "*",
        ("nan",),
        ".*",
        f"{ITEM_7}: a NaN weight is loaded; the capture fails naming the captured tensors it reaches, not the weight",
        message="NaN/Inf values",
    ),
    Rule(
        "target",
        ("nan",),
        r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|q_norm|k_norm)\.weight",
        f"{ITEM_7}: a NaN query or key weight passes: every score is NaN and torch's CPU attention returns "
        "finite values all the same (measured on the Llama and Qwen3 targets), so no check sees it",
    ),
    Rule(
        "draft",
        TENSOR_KINDS,
        "(midlayer|layers\\.0)\\..*",
        f"{ITEM_7}: the draft loader names a layer tensor by its own name (layer.*), not the stored one",
        message=r"(tensor|tensors missing from the checkpoint:) layer\.",
    ),
    Rule(
        "target",
        ("dropped",),
        r".*\.experts\.\d+\..*",
        f"{ITEM_7}: the lint's target-weights check lists no MoE expert tensor; transformers' refusal names none",
        message="transformers cannot load this target",
    ),
    Rule(
        "target",
        CONFIG,
        ".*",
        f"{ITEM_7}: a target config value transformers rejects (or a key it needs, absent) is refused in "
        "transformers' words, naming no key (or naming the tensors the key implies)",
        message="transformers cannot load this target|^ref: \\w+(Error|Exception)|tensors missing \\(transformers",
    ),
    Rule(
        "target",
        CONFIG,
        "kv_lora_rank|moe_layer_freq|n_shared_experts|num_experts_per_tok|num_key_value_heads|qk_head_dim"
        "|qk_rope_head_dim|rope_parameters\\..*|routed_scaling_factor|scoring_func|topk_method|num_nextn_predict_layers"
        "|norm_topk_prob|rope_interleave",
        f"{ITEM_7}: a DeepSeek-V3 key transformers reads with a default, or not at all, is not checked against "
        "what the weights hold or what the engines read (routed_scaling_factor absent: 2.5, not 1.8)",
    ),
    Rule(
        "target",
        ("number-for-string", "list-for-scalar"),
        "dtype",
        f"{ITEM_7}: the target's dtype is not read (the case's is), so a mistyped one is not refused",
    ),
    Rule(
        "draft",
        ("number-for-string", "list-for-scalar"),
        "torch_dtype|model_type|hidden_act",
        f"{ITEM_7}: a draft config key the reference does not read is not type-checked either",
    ),
    Rule(
        "draft",
        ("string-for-number", "list-for-scalar"),
        "norm_output|norm_before_residual|norm_before_fc|fc_norm|attention_bias|eagle_config\\.use_aux_hidden_state",
        f"{ITEM_7}: a flag written as a string or a list is read for its truth ('false' is true)",
    ),
    Rule(
        "draft",
        ("string-for-number", "list-for-scalar"),
        "max_position_embeddings",
        f"{ITEM_7}: max_position_embeddings is not in the draft config's number check",
    ),
    Rule(
        "draft",
        MISTYPED,
        "rope_parameters\\.rope_type",
        f"{ITEM_7}: a mistyped draft rope_type is refused without naming rope_parameters' key as the user wrote it",
    ),
    Rule(
        "draft",
        ("missing",),
        "num_hidden_layers",
        f"{ITEM_7}: an EAGLE-3 draft without num_hidden_layers loads as one layer; engines default it otherwise",
    ),
    Rule(
        "draft",
        ("missing",),
        "norm_before_residual",
        f"{ITEM_7}: norm_before_residual absent is not flagged though its default differs by format",
    ),
    Rule(
        "draft",
        ("missing",),
        "architectures",
        f"{ITEM_7}: an MLA draft without architectures is read as a Llama draft: refused naming the Llama "
        "tensors it lacks, not the key",
        message="tensors missing from the checkpoint",
    ),
    Rule(
        "draft",
        ("string-for-number", "list-for-scalar"),
        "q_lora_rank|kv_lora_rank|qk_nope_head_dim|qk_rope_head_dim|v_head_dim|rope_parameters\\.original_max_position_embeddings",
        f"{ITEM_7}: the MLA draft's sizes are not in the draft config's number check",
    ),
    Rule(
        "draft",
        CONFIG,
        "rope_interleave|rope_parameters\\.(beta_fast|beta_slow|mscale|mscale_all_dim)",
        f"{ITEM_7}: the MLA draft's rope_interleave is read for its truth, and a yarn parameter absent takes "
        "its default, neither checked",
    ),
    Rule(
        "target",
        ("nan",),
        r"model\.layers\.\d+\.mlp\.experts\.\d+\..*",
        f"{ITEM_7}: a NaN in a MoE expert no prompt token is routed to reaches no captured tensor: it passes "
        "(DeepSeek-V3's experts 5, 7 and 4 of layers 2, 3 and 4 in the exhaustive run)",
    ),
    Rule(
        "draft",
        ("dropped", "truncated", "grown"),
        "t2d",
        f"{ITEM_7}: a t2d cut short or grown by one (or absent, beside d2t) passes every check: its length "
        "is not compared with the target's vocab",
    ),
    Rule(
        "draft",
        ("dropped",),
        "embed_tokens\\.weight",
        f"{ITEM_7}: an MLA draft without its embedding shares the target's silently (the Llama-style drafts "
        "get the lint's embedding-shared warning)",
    ),
    Rule(
        "target",
        ("missing",),
        "hidden_size|vocab_size|intermediate_size|head_dim|num_attention_heads|num_key_value_heads"
        "|q_lora_rank|kv_lora_rank|qk_nope_head_dim|qk_rope_head_dim|v_head_dim|moe_intermediate_size|n_routed_experts",
        f"{ITEM_7}: a target size key absent is refused by the tensor shapes it implies, not naming the key",
    ),
    Rule(
        "draft",
        ("missing",),
        "num_key_value_heads|draft_vocab_size|q_lora_rank",
        f"{ITEM_7}: a draft size key absent is refused by the shape it implies, naming the tensor, not the key",
    ),
]


@dataclass(frozen=True)
class Pair:
    """A target and a draft (fixtures, or built here), mutated one side at a time."""

    name: str  # "llama target, eagle3 draft"
    target: Path
    draft: Path
    sides: tuple[str, ...]  # which checkpoints are mutated (the DeepSeek target once, with its Llama-style draft)


PROMPTS = [[1, 5, 9, 33, 77, 101, 7], [4, 8, 15, 16, 23, 42]]


def _qwen3_draft(out: Path) -> Path:
    """An untrained EAGLE-3 draft over the tiny Qwen3 target (no fixture trains one): ids [1, 2, 3]."""
    from transformers import AutoModelForCausalLM

    from difftest_engines.ref.eagle3 import Eagle3Config
    from difftest_engines.ref.train import init_draft, save_eagle_format

    target_dir = fixture_path("tiny-qwen3")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    c = target.config
    cfg = Eagle3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        draft_vocab_size=512,
        target_hidden_size=c.hidden_size,
        num_aux=3,
    )
    draft = init_draft(target, cfg, torch.zeros(512, dtype=torch.long), seed=5)
    save_eagle_format(draft, out, [1, 2, 3])
    return out


def build_pairs(scratch: Path) -> list[Pair]:
    """The four pairs: the fixtures' checkpoints, and an untrained Qwen3 draft built under `scratch`."""
    deepseek = fixture_path("tiny-deepseek-v3")
    both = ("target", "draft")
    return [
        Pair("llama target, eagle3 draft", fixture_path("tiny-llama"), fixture_path("tiny-llama-eagle3"), both),
        Pair(
            "qwen3 target, eagle3 draft",
            fixture_path("tiny-qwen3"),
            _qwen3_draft(scratch / "qwen3-draft"),
            both,
        ),
        Pair("deepseek-v3 target, eagle3 draft", deepseek, fixture_path("tiny-deepseek-v3-eagle3"), both),
        # the DeepSeek target's mutants run once, beside its Llama-style draft
        Pair("deepseek-v3 target, mla draft", deepseek, fixture_path("tiny-deepseek-v3-eagle3-mla"), ("draft",)),
    ]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> list[Pair]:
    return build_pairs(tmp_path_factory.mktemp("pairs"))


def _case_yaml(name: str, target: Path, draft: Path) -> str:
    return yaml.safe_dump(
        {
            "name": name,
            "target": str(target),
            "draft": str(draft),
            "dtype": "float32",
            "wiring": "vllm",
            "prompts": [{"ids": p} for p in PROMPTS],
            "speculative": {"num_steps": 2, "max_new_tokens": 4},
        },
        sort_keys=False,
    )


@dataclass
class Item:
    check: str  # load, lint, capture
    outcome: str  # passed, failed, error
    message: str


def _items(junit: Path, reports: Path) -> dict[str, list[Item]]:
    """Case name -> its items' outcomes and messages: a case's checks from its report (which tells a
    check's error, a refusal, from its failure, a verdict), a case that did not load from the JUnit XML."""
    out: dict[str, list[Item]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        where = f"{case.get('classname')}::{case.get('name')}"
        match = re.search(r"(m\d{4}|pristine)\.yaml", where)
        assert match, where
        name = match.group(1)
        report = reports / f"{name}.json"
        if report.exists():
            checks = json.loads(report.read_text())["checks"]
            out[name] = [Item(c["check"], c["outcome"], c["message"]) for c in checks]
            continue
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        text = "" if bad is None else (bad.text or bad.get("message") or "")
        text = re.sub(r"\nreport: \S+\s*$", "", text.strip())  # where the report is: not the message
        out.setdefault(name, []).append(Item(case.get("name") or "", "passed" if bad is None else "error", text))
    return out


def _new_lines(items: list[Item], pristine: list[Item], paths: tuple[Path, ...]) -> list[tuple[str, str]]:
    """(outcome, line) of every message line the pristine case did not print: what the mutant made the
    run say (checkpoint folders written as <ckpt>, so a path is no difference)."""

    def lines(of: list[Item]) -> list[tuple[str, str]]:
        out = []
        for i in of:
            text = i.message
            for p in paths:
                text = text.replace(str(p), "<ckpt>")
            out += [(i.outcome, line) for line in text.splitlines()]
        return out

    before = {line for _, line in lines(pristine)}
    return [(o, line) for o, line in lines(items) if line not in before]


def _names(message: str, m: cm.Mutant) -> bool:
    """Whether the message names the mutated tensor (as stored, or without its `model.` prefix) or key."""
    keys = {m.key, m.key.removeprefix("model.")}
    # a config key counts as named in its dotted place too (rope_parameters.beta_fast names beta_fast)
    if m.kind in cm.CONFIG_KINDS and re.search(rf"(?<![\w.]){re.escape(m.name)}(?!\w)", message):
        return True
    return any(re.search(rf"(?<![\w.]){re.escape(k)}(?!\w)", message) for k in keys)


def classify(m: cm.Mutant, items: list[Item], pristine: list[Item], paths: tuple[Path, ...]) -> str:
    c = _classify(m, items, pristine, paths)
    if c in BAD and any(rule.covers(m, items) for rule in KNOWN):
        return "known"
    if c in BAD and any(rule.covers(m, items) for rule in OPEN):
        return "open"
    return c


def _classify(m: cm.Mutant, items: list[Item], pristine: list[Item], paths: tuple[Path, ...]) -> str:
    failed = [i for i in items if i.outcome != "passed"]
    new = _new_lines(items, pristine, paths)
    if any("Traceback" in i.message or "internal error" in i.message for i in failed):
        return "refused-unnamed"
    # a refusal (the case or its models cannot run: the load item, a check's error) is one line
    if any(i.outcome == "error" and "\n" not in i.message and _names(i.message, m) for i in failed):
        return "refused-named"
    if failed:
        # a verdict (a check ran and failed: the lint's findings, one a line) names it in a line of its own
        return "verdict-named" if any(o == "failed" and _names(line, m) for o, line in new) else "refused-unnamed"
    if any(_names(line, m) for _, line in new):
        return "warned-named"  # every check passes, one says what changed (a lint warning)
    return "optional" if any(rule.covers(m, items) for rule in OPTIONAL) else "accepted-silently"


def run_pair(pair: Pair, picked: list[cm.Mutant], root: Path) -> tuple[dict[str, list[Item]], str]:
    cases = root / "cases"
    cases.mkdir(parents=True)
    (cases / "pristine.yaml").write_text(_case_yaml("pristine", pair.target, pair.draft))
    for i, m in enumerate(picked):
        mutated = m.write(root / "ckpt" / f"m{i:04d}")
        target, draft = (mutated, pair.draft) if m.side == "target" else (pair.target, mutated)
        (cases / f"m{i:04d}.yaml").write_text(_case_yaml(f"m{i:04d}", target, draft))
    junit = root / "junit.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "difftest.cli", "run", "cases/", "--engines=ref", "--no-capture-cache"]
    proc = subprocess.run(
        [*command, "--out", str(root / "reports"), "-q", f"--junitxml={junit}", "-p", "no:cacheprovider"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert junit.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return _items(junit, root / "reports"), proc.stdout + proc.stderr


def test_every_checkpoint_mutant_is_refused_or_fails_a_check_naming_what_changed(pairs, tmp_path):
    rng = random.Random(SEED)
    lines = [f"checkpoint fuzz: DIFFTEST_FUZZ_SEED={SEED} DIFFTEST_FUZZ_PER_KIND={PER_KIND}"]
    print(lines[0])
    flagged: list[str] = []
    for n, pair in enumerate(pairs):
        every = [m for side in pair.sides for m in cm.mutants(pair.target if side == "target" else pair.draft, side)]
        picked = cm.sample(every, PER_KIND, rng)
        drawn_kinds = {(m.side, m.kind) for m in picked}
        expected_kinds = {(s, k) for s in pair.sides for k in cm.KINDS}
        assert drawn_kinds == expected_kinds, f"{pair.name}: no mutant of {expected_kinds - drawn_kinds}"
        root = tmp_path / f"pair{n}"
        items, output = run_pair(pair, picked, root)
        pristine = items.get("pristine", [])
        assert pristine and all(i.outcome == "passed" for i in pristine), (pair.name, pristine, output[-2000:])
        classes: Counter[str] = Counter()
        for i, m in enumerate(picked):
            got = items.get(f"m{i:04d}")
            assert got, f"{pair.name}: {m.label()}: no item ran\n{output[-2000:]}"
            paths = (root / "ckpt" / f"m{i:04d}", pair.target, pair.draft)
            c = classify(m, got, pristine, paths)
            classes[c] += 1
            if c in (*BAD, "known", "open"):
                rules = KNOWN if c == "known" else OPEN if c == "open" else []
                why = next((f" [{r.why}]" for r in rules if r.covers(m, got)), "")
                detail = " | ".join(
                    f"{it.check} {it.outcome}: {it.message[:300]}" for it in got if it.outcome != "passed"
                )
                flagged.append(
                    f"{pair.name}: {c}: {m.label()}{why}: " + (detail or "every check passed").replace("\n", " / ")
                )
        line = f"{pair.name}: {len(picked)} mutants of {len(every)}: " + ", ".join(
            f"{classes[c]} {c}" for c in (*GOOD, "known", "open", *BAD) if classes[c]
        )
        print(line)
        lines.append(line)
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text("\n".join([*lines, *flagged]) + "\n")
    bad = [f for f in flagged if any(f": {b}: " in f for b in BAD)]
    assert not bad, f"DIFFTEST_FUZZ_SEED={SEED}: {len(bad)} bad mutant(s) (all in {REPORT}):\n" + "\n".join(bad[:40])
