"""The `difftest train-acc` and `difftest dump` commands, contributed to the CLI through the
`difftest.commands` entry points (difftest.base.extensions): their arguments and what they run.

    difftest train-acc --data DIR --draft CKPT --target CKPT [--hidden-states DIR] [--split val] [--wiring vllm ...]
        the trainer's accuracy of a draft on a dump under the training wiring, and under each
        engine wiring side by side (fc rebuilt from the dumped tensors by identity); --hidden-states:
        the speculators hs_*.safetensors folder when it is not DATA/hidden_states; --split val: the trainer's
        validation split (difftest_engines.trainingdata.split)
    difftest dump --target CKPT --out DIR --format speculators --layers h0+h2+h4+h7 [--case FILE ...]
        write training data from the reference target
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from difftest.api import definitions
from difftest.api import normalise
from difftest.api import Case, Prompt, load_case
from difftest.api import CASE_DTYPES, torch_dtype
from difftest.api import EngineSpec
from difftest.api import ConfigError, DifftestError
from difftest.api import Command, TROUBLE, USAGE, deprecated_alias, id_list, non_empty, whole_number
from difftest.api import atomic_write, check_output_dir, check_output_file
from difftest.api import read_json, short_name


def _model(ref: str) -> str:
    if ref.startswith("fixture:"):
        from difftest.api import resolve_fixture

        return resolve_fixture(ref)
    return str(Path(ref).resolve())


def _ratio(text: str) -> float:
    """--train-data-ratio: 0 < R < 1, as speculators' own create_train_val_loaders demands; refused by
    the parser (exit 4) naming the option, not later as a setting of a case the user never wrote."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0.0 < value < 1.0:  # nan fails this too
        raise argparse.ArgumentTypeError(f"expected 0 < R < 1 (speculators' rule), got {text}")
    return value


def _target_shape(target: str) -> tuple[int, int]:
    """The target's depth and vocabulary from its config.json (a text_config inside, for a multimodal
    one): what --layers and --random are read against, before the model loads."""
    config = read_json(Path(target) / "config.json", "target config")
    text = config.get("text_config", config) if isinstance(config, dict) else None
    try:
        return int(text["num_hidden_layers"]), int(text["vocab_size"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{target}: target config: num_hidden_layers and vocab_size must be whole numbers") from None


def train_acc(args) -> int:
    from difftest_engines.trainingdata.engine import TrainingDataEngine
    from difftest_engines.trainingdata.train_accuracy import StepCounts, describe_attention, packing_line, rules_for
    from difftest_engines.trainingdata.trainer_forward import is_llama_draft

    if args.trainer is not None:
        try:
            rules_for(args.trainer, where="--trainer")  # a bad option value: refused as typed, before anything
        except ConfigError as e:
            print(f"difftest train-acc: {e}", file=sys.stderr)
            return USAGE
    try:
        if args.json:  # checked before the computation, not found unwritable after it
            check_output_file(args.json, "--out")
    except DifftestError as e:
        print(f"difftest train-acc: {e}", file=sys.stderr)
        return TROUBLE
    data = Path(args.data).resolve()
    hidden_states = Path(args.hidden_states).resolve() if args.hidden_states else None
    rows = []
    try:
        if hidden_states is not None and not hidden_states.is_dir():  # named as typed, before anything loads
            raise ConfigError(f"--hidden-states: {args.hidden_states}: directory not found")
        # inside the try: an unknown fixture or a bad checkpoint path is one line too
        case = Case(
            name="train-acc",
            path=str(data / "train-acc"),
            target=_model(args.target),
            draft=_model(args.draft),
            dtype=args.dtype,
            layer_ids=args.layer_ids,
            prompts=[Prompt(ids=[0, 0])],
            num_steps=args.ttt_steps or 3,
            engines={
                "train": {
                    k: v
                    for k, v in {
                        "data": str(data),
                        "format": args.format,
                        "identify": args.identify,
                        "ttt_steps": args.ttt_steps,
                        "max_len": args.max_len,
                        "trainer": args.trainer,
                        "hidden_states": str(hidden_states) if hidden_states else None,
                        "split": args.split,
                        "train_data_ratio": args.train_data_ratio,
                    }.items()
                    if v is not None
                }
            },  # unset: the default
        )
        for wiring in [None, *args.wiring]:
            engine = TrainingDataEngine(EngineSpec("train", params=(("wiring", wiring),) if wiring else ()))
            s = engine.settings(case)
            dump = engine.dump(s)
            split = engine.split(case, s, dump)  # refused before any model loads
            w, head = engine.head(case, s)
            loaded = engine.draft(case, w)
            ident = engine.identification(case, s, dump, w)
            if wiring is None:
                hs = f"; hidden states from {hidden_states}" if hidden_states else ""
                print(
                    f"training data: {data} ({dump.format}, {len(dump.samples)} samples, {len(dump.skipped)} skipped{hs})"
                )
                for line in dump.skipped:
                    print(f"  skipped: {line}")
                print(ident.summary())
                rules, rules_name = engine.rules(case, s, dump)
                print(f"scored with {rules_name}'s rules")
                print(f"attention: {describe_attention(loaded.config, rules)}")
                if rules.draft_forward == "specforge" and not is_llama_draft(loaded.model):
                    # SpecForge 0.2.0's one EAGLE-3 draft class is modeling/draft/llama3_eagle.py::LlamaForCausalLMEagle3
                    print(
                        f"draft forward: the reference draft's; {rules.name} has no draft of this kind (its EAGLE-3 draft "
                        "is Llama's), so its arithmetic is not followed"
                    )
                print(f"scored: {split.describe()}")
                precision = engine.precision(case)
                for note in ident.notes:
                    print(f"  {note}")
                names = [n or f"dump[{j}]" for j, n in enumerate(ident.fc_names)]
                label = f"trainer ({dump.format})"
            else:
                names = engine.engine_wiring(case, s, ident, loaded)
                label = wiring
            acc = engine.accuracy(case, s, dump, ident, loaded, head)
            rows.append({"wiring": label, "fc": [short_name(n) for n in names], **acc.to_dict()})
    except DifftestError as e:
        print(f"difftest train-acc: {e}", file=sys.stderr)
        return TROUBLE
    width = max(len(r["wiring"]) for r in rows)
    # the trainer's own figure for full_acc (speculators full_acc_k, SpecForge acc_k) and the accept
    # length it predicts, converted by its definition (difftest.base.definitions)
    figure = (definitions.trainer_figures(rules_name) or ("speculators.full_acc",))[0]
    print(
        f"{'wiring'.ljust(width)}  {'fc'.ljust(18)}  full_acc (ttt 0..{len(rows[0]['counted']) - 1})   cond_acc   predicted AL"
    )
    for r in rows:
        fc = "[" + ", ".join(r["fc"]) + "]"
        full = " ".join(f"{a:.3f}" for a in r["full_acc"])
        cond = " ".join(f"{a:.3f}" for a in r["cond_acc"])
        r["predicted_accept_length"] = predicted = normalise(
            figure, steps=[0.0 if a != a else a for a in r["full_acc"]]
        )
        print(f"{r['wiring'].ljust(width)}  {fc.ljust(18)}  {full}   {cond}   {predicted:.2f}")
    print(
        f"({rows[0]['counted'][0]} loss-masked positions at step 0; targets = argmax of the dumped verifier's logits)"
    )
    print(
        f"correct {rows[0]['correct']} of {rows[0]['counted']}; cond {rows[0]['cond_correct']} of {rows[0]['cond_counted']}"
    )
    print(precision.line(rows[0]["near_ties"], rules_name))
    if rules.forward_dtype and rules.forward_dtype != args.dtype:
        print(
            f"trainer dtype: {rules.name} computes these counts in its training forward in {rules.forward_dtype} only; "
            f"scored in {args.dtype}, they are not its own: --dtype {rules.forward_dtype} gives them exactly"
        )
    packed = packing_line(StepCounts.from_dict(rows[0]))
    if packed:
        print(packed)
    print("definitions:")
    for line in definitions.lines([figure, *definitions.trainer_figures(rules_name), definitions.ACCEPT_LENGTH]):
        print(f"  {line}")
    if args.json:
        try:
            atomic_write(args.json, json.dumps({"data": str(data), "rows": rows}, indent=1) + "\n")
        except OSError as e:  # what the check up front cannot foresee (a full disk); no partial file is left
            print(f"difftest train-acc: --out: {args.json}: {e.strerror or e}", file=sys.stderr)
            return TROUBLE
    return 0


def dump(args) -> int:
    from difftest_engines.trainingdata.dump import dump_from_target, parse_layers, random_prompts

    prompts: list[list[int]] = []
    try:
        target = _model(args.target)  # inside: an unknown fixture is one line too
        check_output_dir(args.out, "--out")  # before the target runs, not after
        depth, vocab = _target_shape(target)
    except DifftestError as e:
        print(f"difftest dump: {e}", file=sys.stderr)
        return TROUBLE
    try:  # a bad option value (exit 4), refused before the target loads
        layers = parse_layers(args.layers, depth)
    except DifftestError as e:
        print(f"difftest dump: {e}", file=sys.stderr)
        return USAGE
    try:
        for path in args.case:
            case = load_case(path)
            for p in [*case.prompts, *case.spec_prompts]:
                if p.ids is None:
                    raise DifftestError(f"{path}: text prompts are not supported by dump yet; give {{ids: [...]}}")
                prompts.append(p.ids)
        if args.random:
            prompts += random_prompts(vocab, args.random, args.length, args.seed)
        if not prompts:
            raise DifftestError("no prompts: give --case FILE and/or --random N")
        out = dump_from_target(
            target,
            args.out,
            args.format,
            layers,
            prompts,
            args.continue_tokens,
            torch_dtype(args.dtype),
        )
    except DifftestError as e:
        print(f"difftest dump: {e}", file=sys.stderr)
        return TROUBLE
    print(f"wrote {len(prompts)} samples ({args.format}, tensors {args.layers}) to {out}")
    return 0


def train_acc_arguments(t: argparse.ArgumentParser) -> None:
    t.add_argument("--data", required=True, help="training data directory (speculators, legacy .pt or SpecForge .ckpt)")
    t.add_argument("--draft", required=True, help="draft checkpoint or fixture:NAME")
    t.add_argument(
        "--target", required=True, help="target checkpoint or fixture:NAME (its lm_head/norm make the targets)"
    )
    t.add_argument(
        "--hidden-states",
        default=None,
        metavar="DIR",
        help="the speculators hs_*.safetensors folder when it is not DATA/hidden_states "
        "(generate-offline-data --output, the trainer's --hidden-states-path)",
    )
    t.add_argument("--format", default="auto", help="speculators | speculators-legacy | specforge | auto")
    t.add_argument(
        "--identify",
        default="target",
        choices=["target", "stats"],
        help="identify dumped layers by a target run or by statistics",
    )
    t.add_argument(
        "--wiring",
        type=non_empty("give a preset or h2+h4+h7"),
        action="append",
        default=[],
        help="an engine wiring to compare (preset or h2+h4+h7); repeatable",
    )
    t.add_argument(
        "--layer-ids", type=id_list, default=None, help="ids the presets read (default: the draft config's), e.g. 2,4,7"
    )
    t.add_argument(
        "--ttt-steps",
        type=whole_number(1),
        default=None,
        help="TTT unroll depth (default: the trainer's, 3 speculators / 7 SpecForge)",
    )
    t.add_argument(
        "--max-len",
        type=whole_number(1),
        default=None,
        help="truncate samples as the trainer does (default: the trainer's)",
    )
    t.add_argument(
        "--trainer",
        default=None,
        help="rules to score with: speculators@VERSION | specforge@VERSION "
        "(default: the draft config's speculators_version, else by data format)",
    )
    t.add_argument(
        "--split",
        default="all",
        choices=["all", "train", "val"],
        help="score all samples, or the trainer's training / validation split (speculators: rows "
        "[int(N*ratio), N) are validation); refused when the data cannot reproduce it",
    )
    t.add_argument(
        "--train-data-ratio",
        type=_ratio,
        default=None,
        metavar="R",
        help="the trainer's --train-data-ratio for --split (default: the run.yaml `speculators train` saved "
        "beside the draft; speculators' own default is 0.9)",
    )
    t.add_argument("--dtype", default="float32", choices=[d.value for d in CASE_DTYPES])
    t.add_argument("--out", dest="json", default=None, metavar="FILE", help="also write the table as JSON here")
    # --json is every command's machine-readable output flag; a path after it is this command's old spelling
    deprecated_alias(t, ["--json"], "--out", "json")


def dump_arguments(d: argparse.ArgumentParser) -> None:
    d.add_argument("--target", required=True, help="target checkpoint or fixture:NAME")
    d.add_argument("--out", required=True)
    d.add_argument("--format", required=True, choices=["speculators", "speculators-legacy", "specforge"])
    d.add_argument("--layers", required=True, help="dumped tensors in file order, the verifier last, e.g. h0+h2+h4+h7")
    d.add_argument("--case", action="append", default=[], help="dump this case's prompts (repeatable)")
    d.add_argument("--random", type=whole_number(0), default=0, help="also dump N random prompts")
    d.add_argument("--length", type=whole_number(1), default=12, help="length of the random prompts")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--continue",
        dest="continue_tokens",
        type=whole_number(0),
        default=8,
        help="greedy continuation tokens (loss-masked)",
    )
    d.add_argument("--dtype", default="float32", choices=[d.value for d in CASE_DTYPES])


# registered under the `difftest.commands` entry points (pyproject.toml)
TRAIN_ACC = Command(
    "train-acc",
    "a draft's training accuracy on a dump: trainer's wiring vs engine wirings",
    train_acc_arguments,
    train_acc,
)
DUMP = Command("dump", "write speculators / SpecForge training data from the reference target", dump_arguments, dump)
