"""The training side as an engine: captures read from offline training data, not a model run.

    train[data=PATH,format=speculators]      or, per case:  engines: {train: {data: ..., format: ...}}

Settings (spec parameters override the case's `engines.train`):
  data       the dump directory (relative to the case file; `fixture:NAME` for built-in dumps)
  format     speculators | speculators-legacy | specforge | auto (default auto)
  hidden_states  the speculators hs_*.safetensors folder when it is not DATA/hidden_states
             (`generate-offline-data --output`, the trainer's `--hidden-states-path`)
  identify   target (default: match dumped tensors to the case target's residual stream)
             | stats (no target run: norm profile, embedding rows, verifier top-1)
  wiring     feed fc with these tensors instead of the trainer's (e.g. h2+h4+h7: what a serving
             engine feeds); taken from the dump by identity, else from the reference target
  ttt_steps  training-accuracy unroll depth (default: the trainer's own, 3 speculators / 7 SpecForge)
  max_len    truncate every sample to this many tokens before scoring, as the trainer does
             (default: the trainer's, 8192 speculators `--total-seq-len` / 2048 SpecForge)
  split      all (default) | train | val: the trainer's training / validation split of speculators data
             (rows [int(N*ratio), N) are validation; difftest_engines.trainingdata.split), refused when it cannot
             be reproduced from the data
  train_data_ratio  the trainer's --train-data-ratio (default: the run.yaml `speculators train` saved
             beside the draft)
  trainer    whose rules score the accuracy: speculators@VERSION | specforge@VERSION (default: the
             draft config's `speculators_version` for speculators data, else speculators@0.9 /
             speculators@0.6 for legacy .pt dumps / specforge@0.2; difftest_engines.trainingdata.train_accuracy)

For a case prompt, the sample whose token ids start with the prompt supplies `draft.fc_in`
exactly as the trainer built it, the dumped tensors under their identified canonical names
(the verifier included), and the draft's tensors from running the reference draft on that
fc input. Capture meta carries the identification, the trainer's accuracy over the whole
dump (difftest_engines.trainingdata.train_accuracy) and every skipped sample's one-line reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import difftest
from difftest.api import AcceptStats
from difftest.api import Capture
from difftest.api import Case
from difftest.api import Engine, EngineInfo
from difftest.api import ConfigError, EngineError
from difftest_engines.trainingdata.layer_identity import Identification, identify_against_target, identify_by_statistics
from difftest_engines.trainingdata.train_accuracy import (
    DEFAULT_TRAINER,
    StepCounts,
    TrainerRules,
    VerifierHead,
    describe_attention,
    rules_for,
    sample_accuracy,
)
from difftest.api import resolve, short_name, trained_layer_ids
from difftest_engines.ref.draft_loading import LoadedDraft, load_draft
from difftest_engines.ref.speculate import capture_draft_chain, gather_fc_in, simulate_greedy
from difftest_engines.ref.target import final_norm_module, load_target, num_layers, run_target
from difftest_engines.trainingdata.formats import Dump, Sample, read_dump
from difftest_engines.trainingdata.trainer_forward import config_norm_output
from difftest_engines.trainingdata.settings import SCHEMA, Settings
from difftest_engines.trainingdata.precision import Precision, draft_precision
from difftest_engines.trainingdata.split import Split, choose_split, samples_in
from difftest.api import FINAL_NORM, TARGET_PREFIX, hidden_name
from difftest.api import CaptureMeta, Wiring

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def target_head_weights(path: str | Path) -> dict[str, torch.Tensor | float]:
    """embed / lm_head / final-norm weights read from a checkpoint's safetensors, without loading the model."""
    from safetensors import safe_open

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    wanted = {"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head", "model.norm.weight": "norm"}
    out: dict = {"eps": float(cfg.get("rms_norm_eps", 1e-6))}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key in wanted:
                    out[wanted[key]] = st.get_tensor(key)
    out.setdefault("lm_head", out.get("embed"))  # tied embeddings
    missing = [v for v in ("embed", "lm_head", "norm") if out.get(v) is None]
    if missing:
        raise ConfigError(f"{path}: cannot find {', '.join(missing)} weights in its safetensors files")
    return out


class TrainingDataEngine(Engine):
    SETTINGS = SCHEMA

    def __init__(self, spec):
        super().__init__(spec)
        self._dumps: dict[tuple, Dump] = {}
        self._targets: dict[tuple, torch.nn.Module] = {}
        self._drafts: dict[tuple, LoadedDraft] = {}
        self._idents: dict[tuple, Identification] = {}
        self._accuracy: dict[tuple, StepCounts] = {}

    def info(self) -> EngineInfo:
        return EngineInfo(
            name="train",
            version=f"difftest-{difftest.__version__}-train-data",
            versions={"torch": torch.__version__},
            kernels="none (offline data)",
        )

    # -- settings --------------------------------------------------------------------
    def settings(self, case: Case) -> Settings:
        s = self.settings_for(case)  # difftest_engines/trainingdata/settings.py
        if not s.data:
            raise ConfigError(
                f"{case.path}: the train engine needs training data: engines.{self.spec.name}.data in the case, "
                f"or --engines '{self.spec.name}[data=PATH]'"
            )
        data = Path(str(s.data))
        if not data.is_absolute():
            data = (Path(case.path).parent / data).resolve()
        s.data = str(data)
        if s.hidden_states:
            hs = Path(str(s.hidden_states))
            s.hidden_states = str(hs if hs.is_absolute() else (Path(case.path).parent / hs).resolve())
        if s.trainer:
            rules_for(str(s.trainer), where=f"{self.spec.id}: trainer")  # refuse a bad value early
        return s

    def rules(self, case: Case, s: Settings, dump: Dump) -> tuple[TrainerRules, str]:
        """The trainer's rules for this dump and how the version was chosen (named in the report)."""
        if s.trainer:
            trainer, how = str(s.trainer), "the trainer setting"
        else:
            trainer, how = DEFAULT_TRAINER[dump.format], "default for the data format"
            if dump.format.startswith("speculators"):
                try:
                    v = json.loads((Path(case.draft) / "config.json").read_text()).get("speculators_version")
                except (OSError, ValueError):
                    v = None
                if isinstance(v, str) and v:
                    trainer, how = f"speculators@{v}", "the draft config's speculators_version"
                    try:
                        rules_for(trainer, where=f"{Path(case.draft) / 'config.json'}: speculators_version")
                    except ConfigError as e:  # a release past the covered ones: the user picks the rules
                        raise ConfigError(
                            f"{e}; or choose the rules with {self.spec.name}[trainer=...] (train-acc: --trainer)"
                        ) from None
        return rules_for(trainer, where=f"{self.spec.id}: trainer"), f"{trainer} ({how})"

    # -- models and data -------------------------------------------------------------
    def dump(self, s: Settings) -> Dump:
        key = (s.data, s.format, s.hidden_states)
        if key not in self._dumps:
            d = read_dump(s.data, s.format, hidden_states=s.hidden_states)
            for line in d.skipped:
                print(f"train data: {line}", file=sys.stderr)
            if not d.samples:
                raise ConfigError(
                    f"{s.data}: no usable sample ({len(d.skipped)} skipped); first: {d.skipped[0] if d.skipped else '-'}"
                )
            self._dumps[key] = d
        return self._dumps[key]

    def target(self, case: Case):
        key = (case.target, case.dtype)
        if key not in self._targets:
            self._targets[key] = load_target(case.target, DTYPES[case.dtype])
        return self._targets[key]

    def head(self, case: Case, s: Settings) -> tuple[dict, VerifierHead]:
        if s.identify == "target":
            t = self.target(case)
            norm = final_norm_module(t)
            w = {
                "embed": t.get_input_embeddings().weight.detach(),
                "lm_head": t.get_output_embeddings().weight.detach(),
                "norm": norm.weight.detach(),
                "eps": float(getattr(norm, "variance_epsilon", 1e-6)),
            }
        else:
            w = target_head_weights(case.target)
        return w, VerifierHead(w["lm_head"], w["norm"], w["eps"])

    def draft(self, case: Case, w: dict) -> LoadedDraft:
        key = (case.draft, case.target, case.dtype)
        if key not in self._drafts:
            self._drafts[key] = load_draft(
                case.draft, target_embed=w["embed"], target_lm_head=w["lm_head"], dtype=DTYPES[case.dtype]
            )
        return self._drafts[key]

    def identification(self, case: Case, s: Settings, dump: Dump, w: dict) -> Identification:
        key = (s.data, s.format, s.hidden_states, s.identify, case.target)
        if key not in self._idents:
            first = dump.samples[0]
            if s.identify == "target":
                res = run_target(self.target(case), first.input_ids[None])
                ref = {hidden_name(k): h[0] for k, h in enumerate(res.hidden)}
                ref[FINAL_NORM] = res.final_norm[0]
                ident = identify_against_target(first.tensors, ref, first.fc_count, num_layers(self.target(case)))
            else:
                some = dump.samples[:8]
                ident = identify_by_statistics(
                    [x.tensors for x in some],
                    [x.input_ids for x in some],
                    [x.loss_mask for x in some],
                    first.fc_count,
                    w["embed"],
                    w["lm_head"],
                    w["norm"],
                    w["eps"],
                    verifier_normed=dump.format == "specforge",
                )
            self._idents[key] = ident
        return self._idents[key]

    def engine_wiring(self, case: Case, s: Settings, ident: Identification, loaded: LoadedDraft) -> list[str]:
        """The `wiring` setting as canonical names; presets read the case's ids, else the draft config's."""
        L = ident.num_layers if ident.num_layers is not None else num_layers(self.target(case))
        cfg = loaded.config
        ids, _ = trained_layer_ids(case.layer_ids, cfg.layer_ids_eagle_config, cfg.layer_ids_top)
        return list(resolve(s.wiring, L, ids, where=f"{self.spec.id}: wiring").inputs)

    def fc_for(
        self, case: Case, s: Settings, sample: Sample, ident: Identification, loaded: LoadedDraft
    ) -> tuple[torch.Tensor, list[str], str]:
        """(fc_in [seq, A*H], input names, source): the trainer's, or the `wiring` setting composed from the dump."""
        if not s.wiring:
            names = [n or f"dump[{j}]" for j, n in enumerate(ident.fc_names)]
            return (
                sample.fc_in,
                names,
                f"training data ({s.format}): the trainer's fc, tensors 0..{sample.fc_count - 1}",
            )
        inputs = self.engine_wiring(case, s, ident, loaded)
        by_name = {t.name: sample.tensors[t.position] for t in ident.tensors if t.name}
        parts, from_target = [], []
        res = None
        for name in inputs:
            if name in by_name:
                parts.append(by_name[name])
                continue
            if s.identify != "target":
                raise ConfigError(
                    f"{self.spec.id}: wiring needs {short_name(name)}, which the dump does not hold (dumped: {ident.summary()})"
                )
            res = res or run_target(self.target(case), sample.input_ids[None])
            parts.append(gather_fc_in(res, [name])[0])
            from_target.append(short_name(name))
        src = f"training data ({s.format}) rewired as [{', '.join(short_name(n) for n in inputs)}]"
        if from_target:
            src += f"; {', '.join(from_target)} from the reference target (not in the dump)"
        return torch.cat(parts, dim=-1), inputs, src

    def split(self, case: Case, s: Settings, dump: Dump) -> Split:
        """The samples scored: all, or the trainer's train / validation split (difftest_engines.trainingdata.split)."""
        return choose_split(dump, s.split or "all", s.train_data_ratio, case.draft, where=f"{self.spec.id}: split")

    def precision(self, case: Case) -> Precision:
        """The draft's stored precision against the scoring dtype (difftest_engines.trainingdata.precision)."""
        return draft_precision(case.draft, case.dtype)

    def check_fits_draft(self, s: Settings, dump: Dump, loaded: LoadedDraft) -> None:
        """Refuse, in one line naming the sample file, a dump the draft cannot be scored on: a matmul
        error or an embedding IndexError deep in the draft otherwise."""
        cfg = loaded.config
        width = cfg.num_aux * cfg.target_hidden_size
        for sample in dump.samples:
            if not s.wiring and sample.fc_in.shape[-1] != width:
                H = sample.tensors[0].shape[-1]
                raise ConfigError(
                    f"{sample.source}: {sample.fc_count} fc tensors of width {H} ({sample.fc_in.shape[-1]} wide), "
                    f"but the draft's fc takes {cfg.num_aux} x {cfg.target_hidden_size} = {width}: the dump holds "
                    "other layers than the draft was trained on"
                )
            bad = ((sample.input_ids < 0) | (sample.input_ids >= cfg.vocab_size)).nonzero()
            if len(bad):
                p = int(bad[0])
                raise ConfigError(
                    f"{sample.source}: input_ids: token id {int(sample.input_ids[p])} at position {p} is outside the "
                    f"target vocabulary of {cfg.vocab_size} (the draft config's vocab_size)"
                )

    def accuracy(
        self, case: Case, s: Settings, dump: Dump, ident: Identification, loaded: LoadedDraft, head: VerifierHead
    ) -> StepCounts:
        self.check_fits_draft(s, dump, loaded)
        rules, _ = self.rules(case, s, dump)
        steps = s.ttt_steps or rules.default_ttt_steps
        max_len = s.max_len or rules.default_max_len
        split = self.split(case, s, dump)
        resolution = self.precision(case).resolution
        key = (
            s.data,
            s.format,
            s.hidden_states,
            str(s.wiring),
            case.draft,
            steps,
            max_len,
            rules.name,
            split.name,
            split.start,
            split.stop,
            case.dtype,
        )
        max_len += 1 if rules.max_len_after_shift else 0  # tokens kept before the shift
        if key not in self._accuracy:
            scored = samples_in(dump, split)
            if not any(bool(x.loss_mask[:max_len].any()) for x in scored):
                # a table of nan and an accept length of 1.00 would read as a draft that learnt nothing
                raise ConfigError(
                    f"{s.data}: every loss_mask of the {len(scored)} scored samples is all zero (first: "
                    f"{scored[0].source if scored else '-'}): no position counts as trained, so there is nothing "
                    "to score; dump the data with its loss masks"
                )
            total = StepCounts()
            norm_output = config_norm_output(case.draft)  # as written: a trainer may read its absence its own way
            for sample in scored:
                fc, _, _ = self.fc_for(case, s, sample, ident, loaded)
                total = total.add(
                    sample_accuracy(
                        loaded.model,
                        head,
                        fc[:max_len],
                        sample.verifier[:max_len],
                        sample.input_ids[:max_len],
                        sample.loss_mask[:max_len],
                        steps,
                        rules,
                        resolution,
                        norm_output,
                    )
                )
            self._accuracy[key] = total
        return self._accuracy[key]

    # -- the interface ---------------------------------------------------------------
    @torch.no_grad()
    def capture(self, case: Case, prompt_ids: list[int]) -> Capture:
        s = self.settings(case)
        dump = self.dump(s)
        w, head = self.head(case, s)
        loaded = self.draft(case, w)
        self.check_fits_draft(s, dump, loaded)
        ident = self.identification(case, s, dump, w)
        found = dump.find(prompt_ids)
        if found is None:
            drift = self.template_drift(case, prompt_ids, dump)
            if drift is not None:
                raise ConfigError(f"{s.data}: {drift.message()}")
            raise ConfigError(
                f"{s.data}: no sample's token ids start with the prompt {prompt_ids[:8]}{'...' if len(prompt_ids) > 8 else ''} "
                f"({len(dump.samples)} samples read, {len(dump.skipped)} skipped); dump the case's prompts with `difftest dump --case`"
            )
        sample, n = found
        fc, inputs, source = self.fc_for(case, s, sample, ident, loaded)
        dtype = DTYPES[case.dtype]
        tensors: dict[str, torch.Tensor] = {}
        for t in ident.tensors:
            if t.name:
                tensors[t.name] = sample.tensors[t.position][:n].to(dtype)
        if len(sample) > n:
            next_token, next_src = int(sample.input_ids[n]), "the data's next token"
        elif s.identify == "target":
            next_token, next_src = (
                int(run_target(self.target(case), sample.input_ids[None]).logits[0, -1].argmax()),
                "target greedy",
            )
        else:
            next_token = int(head.logits(sample.verifier[-1:], self.rules(case, s, dump)[0])[0].argmax())
            next_src = "the verifier tensor's lm_head top-1"
        fc_in = fc[None, :n].to(dtype)  # [1, n, A*H]
        draft_tensors, drafted = capture_draft_chain(loaded.model, fc_in, prompt_ids, next_token, case.num_steps)
        tensors.update(draft_tensors)
        acc = self.accuracy(case, s, dump, ident, loaded, head)
        rules, trainer_how = self.rules(case, s, dump)
        cfg = loaded.config
        meta = CaptureMeta(
            engine=self.spec.id,
            engine_version=self.info().version,
            versions=self.info().versions,
            kernels="none",
            device="cpu",
            dtype=case.dtype,
            prompt_ids=list(prompt_ids),
            target_next_token=next_token,
            draft_tokens=list(drafted),
            num_layers=ident.num_layers,
            target_hidden_size=cfg.target_hidden_size,
            wiring=Wiring(list(inputs), source, ident.verifier.name),
            # only the dumped tensors exist here; the reference's other target tensors are not missing by mistake
            partial=[TARGET_PREFIX + "*"],
            extra={
                "next_token_source": next_src,
                "train_data": {
                    "path": s.data,
                    "format": dump.format,
                    "sample": sample.source,
                    "samples": len(dump.samples),
                    "skipped": len(dump.skipped),
                    "skipped_lines": dump.skipped[:20],
                    "notes": dump.notes,
                    "identification": ident.to_dict(),
                },
                "train_accuracy": {
                    "rules": rules.name,
                    "trainer": trainer_how,
                    "ttt_steps": len(acc.counted),
                    "attention": describe_attention(cfg, rules),
                    "split": self.split(case, s, dump).describe(),
                    "precision": self.precision(case).line(acc.near_ties),
                    "max_len": s.max_len or rules.default_max_len,
                    "wiring": inputs,
                    **acc.to_dict(),
                },
            },
        )
        return Capture(tensors, meta)

    def template_drift(self, case: Case, prompt_ids: list[int], dump: Dump):
        """Why no sample starts with a chat prompt's serving ids (difftest_engines/trainingdata/chat_template.py);
        None for a prompt not given as chat messages."""
        from transformers import AutoTokenizer

        from difftest.api import chat
        from difftest_engines.trainingdata.chat_template import chat_prompts, find_drift

        prompts = chat_prompts(case.prompts + case.spec_prompts)
        if not prompts:
            return None
        tokenizer = AutoTokenizer.from_pretrained(case.target, local_files_only=True)
        for i, p in prompts:
            if chat.render(tokenizer, p.messages, p.chat_template_kwargs) == list(prompt_ids):
                return find_drift(tokenizer, p, i, dump.samples)
        return None

    @torch.no_grad()
    def speculate(self, case: Case, prompts: list[list[int]], num_steps: int, max_new_tokens: int) -> AcceptStats:
        s = self.settings(case)
        dump = self.dump(s)
        w, _ = self.head(case, s)
        ident = self.identification(case, s, dump, w)
        loaded = self.draft(case, w)
        names = self.engine_wiring(case, s, ident, loaded) if s.wiring else list(ident.fc_names)
        if None in names or s.identify != "target":
            raise EngineError(
                f"{self.spec.id}: training data cannot decode; simulating it needs every fc tensor identified against the "
                f"target (identify=target); got {ident.summary()}"
            )
        stats, _ = simulate_greedy(self.target(case), loaded.model, names, prompts, num_steps, max_new_tokens)
        stats.source = f"ref simulation with the training data's wiring [{', '.join(short_name(n) for n in names)}]"
        return stats

    def close(self) -> None:
        self._targets.clear()
        self._drafts.clear()
        self._dumps.clear()
