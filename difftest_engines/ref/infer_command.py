"""`difftest infer-wiring --target T --draft D [--prompts ...] [--json]`: what was this draft trained on?

Runs the target once over the prompts in this process (difftest_engines.ref.target: every `target.h.{k}`,
the final norm and the logits), then difftest.rules.infer_wiring searches the draft's wiring. Prompts:
case files (their prompts and speculative prompts), prompt sets (.jsonl/.json, read as a case's
`prompts: {file: ...}`: difftest.case.prompt_sets), `ids:1,2,3`, or text (the target's tokenizer;
chat messages through its chat template); default: --random N prompts of --length uniformly random
token ids.
Exit status: 0 decided, 1 cannot tell, 2 a file or model it was given cannot be used, 4 a bad option value
(difftest.base.exit_codes; --prompts ids:... is an option value, a prompt file is a file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from difftest.api import DifftestError
from difftest.api import Command, TROUBLE, USAGE, id_list, whole_number
from difftest.api import FINAL_NORM, TARGET_LOGITS, hidden_name
from difftest.api import CaptureMeta


HELP = "infer which target hidden states a draft was trained on, from its behaviour"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target checkpoint or fixture:NAME")
    p.add_argument("--draft", required=True, help="draft checkpoint or fixture:NAME")
    p.add_argument(
        "--prompts",
        nargs="+",
        default=[],
        metavar="PROMPT",
        help="case YAML files, prompt sets (.jsonl/.json), ids:1,2,3, or text (default: --random prompts)",
    )
    p.add_argument(
        "--random", type=whole_number(1), default=16, help="random prompts when --prompts is not given (default 16)"
    )
    p.add_argument("--length", type=whole_number(2), default=48, help="length of the random prompts (default 48)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--layer-ids",
        type=id_list,
        default=None,
        help="config ids to read as each engine would (default: the draft config's), e.g. 2,4,7",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _resolve(ref: str) -> str:
    from difftest.api import resolve_fixture

    if ref.startswith("fixture:"):
        return resolve_fixture(ref)
    if not (Path(ref) / "config.json").exists():
        raise DifftestError(f"{ref}: checkpoint not found (no config.json)")
    return ref


def prompt_ids(args: argparse.Namespace, target: str, vocab: int) -> list[list[int]]:
    from difftest.api import load_case
    from difftest.api import ConfigError
    from difftest.api import Place, PromptFile, read_prompt_file

    if not args.prompts:  # --random and --length were checked by the parser
        gen = torch.Generator().manual_seed(args.seed)
        return torch.randint(min(4, vocab - 1), vocab, (args.random, args.length), generator=gen).tolist()
    out: list[list[int]] = []
    texts: list[str] = []
    chats: list = []  # Prompts with messages: rendered with the target's chat template
    for p in args.prompts:
        _refuse_path_that_is_not_a_case(p)
        read = []
        if p.lower().endswith((".yaml", ".yml")):
            case = load_case(p)
            read = [*case.prompts, *case.spec_prompts]
        elif p.lower().endswith((".jsonl", ".json")):
            read = read_prompt_file(PromptFile(p), Place("--prompts"))  # relative to the working directory
        for q in read:
            if q.ids is not None:
                out.append(list(q.ids))
            elif q.messages is not None:
                chats.append(q)
            else:
                texts.append(q.text)
        if read:
            continue
        if p.startswith("ids:"):
            out.append(_ids(p))
        else:
            texts.append(p)
    if texts or chats:
        from transformers import AutoTokenizer

        from difftest.api import chat

        try:
            tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--prompts: text needs the target's tokenizer, which {target} lacks ({e})") from None
        out += [tok(t)["input_ids"] for t in texts]
        for q in chats:
            try:
                out.append(chat.render(tok, q.messages, q.chat_template_kwargs))
            except Exception as e:  # no template, or one that raises: the user's input, one line
                raise ConfigError(f"--prompts: cannot render chat messages: {str(e).splitlines()[0]}") from None
    bad = [i for i, ids in enumerate(out) if len(ids) < 2 or min(ids) < 0 or max(ids) >= vocab]
    if bad:
        raise ConfigError(f"--prompts: prompt {bad[0]} needs at least 2 token ids in [0, {vocab})")
    return out


def _ids(p: str) -> list[int]:
    """One `--prompts ids:1,2,3` value; malformed, a bad option value (PromptsUsageError, exit 4)."""
    try:
        return [int(x) for x in p[4:].replace(",", " ").split()]
    except ValueError:
        raise PromptsUsageError(f"--prompts: {p!r} is not ids:1,2,3") from None


class PromptsUsageError(DifftestError):
    """A --prompts value malformed in itself (exit 4), where a file it names that cannot be used is 2."""


def check_options(args: argparse.Namespace) -> None:
    """The option values checked by their form, before any model or file is read (PromptsUsageError)."""
    for p in args.prompts:
        if p.startswith("ids:"):
            _ids(p)


# What a file name looks like: --prompts reads case YAML files and prompt sets, so any other file, or
# one that does not exist, is a mistake to name, not text to tokenize.
_FILE_SUFFIXES = (".yaml", ".yml", ".json", ".jsonl", ".txt")


def _refuse_path_that_is_not_a_case(p: str) -> None:
    """--prompts takes case YAML files, prompt sets, ids:1,2,3, or text: one word that looks like a path (a file
    suffix, a path separator) is a path, so a missing one is refused naming it rather than
    tokenized as a prompt. Text with spaces stays text ("what is 1/2?")."""
    from difftest.api import ConfigError

    if p.startswith("ids:") or any(c.isspace() for c in p):
        return
    looks_like_path = p.lower().endswith(_FILE_SUFFIXES) or "/" in p or os.sep in p
    if not looks_like_path:
        return
    path = Path(p)
    if not path.exists():
        raise ConfigError(
            f"--prompts: {p}: no such file (a path, not prompt text: --prompts reads case YAML files, "
            "prompt sets (.jsonl, .json), ids:1,2,3 or text)"
        )
    if path.is_dir() or not p.lower().endswith((".yaml", ".yml", ".jsonl", ".json")):
        raise ConfigError(
            f"--prompts: {p}: not a case YAML file or a prompt set (--prompts reads case files, .jsonl/.json "
            "prompt sets, ids:1,2,3 or text)"
        )


@torch.no_grad()
def infer(target_ref: str, draft_ref: str, prompts: list[list[int]], layer_ids: list[int] | None = None):
    from difftest.api import Capture
    from difftest.api import infer_case
    from difftest_engines.ref.infer_draft import load_inference_draft
    from difftest.api import evidence_from_captures, infer_from_evidence, trained_layer_ids
    from difftest_engines.ref.target import load_target, run_target

    target_dir, draft_dir = _resolve(target_ref), _resolve(draft_ref)
    model = load_target(target_dir)
    caps = []
    for ids in prompts:
        out = run_target(model, torch.tensor([ids]))
        t = {hidden_name(k): h[0] for k, h in enumerate(out.hidden)}
        t[FINAL_NORM], t[TARGET_LOGITS] = out.final_norm[0], out.logits[0]
        caps.append(Capture(t, CaptureMeta(prompt_ids=list(ids), num_layers=len(out.hidden) - 1)))
    loaded = load_inference_draft(draft_dir, target_dir)
    evidence = evidence_from_captures(caps, f"reference target run over {len(prompts)} prompts")
    ids, _ = trained_layer_ids(layer_ids, loaded.config.layer_ids_eagle_config, loaded.config.layer_ids_top)
    return infer_from_evidence(loaded.model, ids, evidence, infer_case.target_family(target_dir))


def main(args: argparse.Namespace) -> int:
    from difftest.api import read_json

    try:
        check_options(args)
    except PromptsUsageError as e:
        print(f"difftest infer-wiring: {e}", file=sys.stderr)
        return USAGE
    try:
        target = _resolve(args.target)
        vocab = int(read_json(Path(target) / "config.json").get("vocab_size") or 0)
        result = infer(target, args.draft, prompt_ids(args, target, vocab), args.layer_ids)
    except DifftestError as e:
        print(f"difftest infer-wiring: {e}", file=sys.stderr)
        return TROUBLE
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print("\n".join(result.lines()))
    return 0 if result.decided else 1


# registered under the `difftest.commands` entry points (pyproject.toml)
INFER_WIRING = Command("infer-wiring", HELP, add_arguments, main)
