"""The reference engine: a transformers target plus the plain-PyTorch EAGLE-3 draft.

Its wiring is explicit: the engine spec's `wiring` parameter, else the case's
`engines.ref.wiring`, else the case's `wiring` (what the draft was trained on). A preset
translates layer ids (spec `layer_ids=2+4+5`, else the case's `layer_ids`, else the
draft config's) the way that ecosystem does, so `ref[wiring=sglang]` answers "what if
an engine wired this draft like SGLang" without SGLang installed.

Spec parameters that make the reference draft *compute* like a misconfigured engine:
`norm_before_residual=true|false` and `norm_output=true|false` override the draft
config's flags (failure class 7), `norm_before_fc=false` and `fc_norm=false` ignore the
EAGLE-3.1 fc norms (their weights stay unused), `d2t=identity` drops the vocab map (class 8). They
change the draft, not the wiring, so the golden-input re-run tells them apart.

`device=cuda` (or `cuda:N`; the worker's, so a spec parameter) runs the target and the draft there,
the float64 noise-floor run too when this spec calibrates; captures come back on the CPU
(difftest_engines/ref/device.py). `device=cpu`, the default, is the computation as it always was.
"""

from __future__ import annotations


import torch

import difftest
from difftest.api import AcceptStats
from difftest.api import Capture
from difftest.api import Case, DType, torch_dtype
from difftest.api import Engine, EngineInfo
from difftest.api import ConfigError
from difftest.api import Wiring, resolve, trained_layer_ids
from difftest_engines.ref import device as placement
from difftest_engines.ref.draft_loading import LoadedDraft, load_draft
from difftest_engines.ref.matmul_precision import emulated
from difftest_engines.ref.settings import SCHEMA
from difftest_engines.ref.speculate import capture_draft_chain, gather_fc_in, simulate_greedy
from difftest_engines.ref.eagle3 import canonical_key
from difftest_engines.ref.mapped import Mapped
from difftest_engines.ref.streamed import NotStreamable, StreamedTarget, streamable
from difftest_engines.ref.target import load_target, num_layers, run_target
from difftest.api import FC_IN, FINAL_NORM, TARGET_LOGITS, hidden_name
from difftest.api import CaptureMeta, ReplayRow
from difftest.api import STREAMED_FLOAT64

# float64 is not a case dtype: the harness asks for it to measure the noise floor (difftest.compare.noise)
# Part of the engine version (so of every capture-cache key): bumped when what a ref capture holds
# changes. 2: norms and rope keep float64 in the noise-floor run; MoE routers recorded (aux.router.*).
# 3: the float64 run streamed layer by layer (the same tensors), its captures' notes say so.
# 4: the routers' chosen expert ids recorded (aux.router.{k}.experts: routing compared row by row).
# 5: draft.*logits_target stored as their columns (difftest.records.scattered; capture schema /2).
# 6: the streamed float64 run's output head in vocabulary chunks (logits ~1e-15 of their scale apart).
CAPTURE_REVISION = 6

# Draft flags a spec or case can override to compute the draft as an engine that reads them otherwise
OVERRIDABLE_FLAGS = ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm")

DTYPES = {d: torch_dtype(d) for d in DType}  # the case computes in one; the calibration run in float64


def rounded_through(model: torch.nn.Module, weights_dtype: str | None) -> torch.nn.Module:
    """`model`'s floating-point weights as `weights_dtype` rounds them, kept in the model's own dtype
    (Case.weights_dtype: the float64 calibration run computes the model the engines load)."""
    if weights_dtype is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.copy_(p.to(DTYPES[weights_dtype]).to(p.dtype))
    return model


class RefEngine(Engine):
    SETTINGS = SCHEMA
    CALIBRATES = True  # the noise floor, the default engine and reference (difftest.base.registry.calibration_engine)
    # what its worker holds (difftest.run.memory_plan.MemoryFactors): one interpreter with torch and
    # transformers; every case's models stay loaded (the _targets/_drafts dicts). The float64 calibration
    # run is streamed (STREAM_FLOAT64) from the case's own load, or the checkpoint's files where the worker
    # holds no such load (STREAM_FROM_FILES): the target's largest layer or head in float64 beside the
    # draft's float64 copy, less its embedding table (its rows are looked up from the draft's file:
    # _stream_draft_embedding) (calibration_streamed counts exactly these; a fixed
    # share of the whole copy, 0.5, counted 36 GB for an 8B target where these are 12 GB). A checkpoint
    # that cannot stream (stored wider than float32) loads the whole copy, which this under-counts
    MEMORY = {"overhead_gb": 0.8, "keeps_every_case": True, "calibration_streamed": True}
    # The float64 run streamed layer by layer from the case's own model (difftest_engines/ref/streamed.py)
    # whenever the checkpoint allows it: bit-identical to the whole float64 copy, which it never holds
    # (one layer or the head in float64 at a time). Always, not only when the copy would not fit: measured
    # on a 1.0B Llama (benchmarks/test_bench_streamed_float64.py) peak RSS 3.8 GiB against 10.3 GiB, a
    # forward 1.19x the whole copy's but no 46 s float64 load. False: the whole copy (tests compare the two).
    STREAM_FLOAT64 = True
    # Where the streamed run reads the weights when this worker does not hold the case's own load (a
    # fresh worker for the calibration, as the memory plan starts one when the two do not fit together):
    # the checkpoint's safetensors files, memory-mapped (difftest_engines/ref/mapped.py), so the worker
    # holds no copy of the target at all (16 GB at the Llama-3.1-8B shape). The same numbers bit for bit
    # (tests/test_streamed_float64.py). False: the case's dtype loaded for it (tests compare the two).
    STREAM_FROM_FILES = True

    def __init__(self, spec):
        super().__init__(spec)
        # where it runs: the spec's, resolved before any model loads (a CUDA device this torch lacks is refused)
        self._asked = self.settings_for(None).device
        self.device = placement.resolve(spec.id, self._asked)
        self._precision = placement.precision() if self.device != placement.CPU else None
        self._fallbacks: list[str] = []  # what running on the device changed (kept in every capture's notes)
        self._targets: dict[tuple, torch.nn.Module] = {}
        self._streams: dict[tuple, StreamedTarget] = {}
        self._stream_notes: dict[tuple, str] = {}
        self._drafts: dict[tuple, LoadedDraft] = {}
        self._trained_flags: dict[tuple, dict[str, bool]] = {}

    def info(self) -> EngineInfo:
        import transformers

        version = f"difftest-{difftest.__version__}-c{CAPTURE_REVISION}"
        versions: dict[str, object] = {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": self.device,
        }
        if self._precision is not None:
            # a GPU's captures are another computation than the CPU's (and TF32 another again): their
            # cache keys apart, whatever the spec is called
            version += "-cuda" + ("-tf32" if placement.tf32(self._precision) else "")
            versions.update(
                {"cuda": str(torch.version.cuda), "gpu": torch.cuda.get_device_name(torch.device(self.device))}
            )
            versions.update(self._precision)
        return EngineInfo(
            name="ref",
            version=version,
            versions=versions,
            kernels=placement.describe(self.device, self._precision),
        )

    # -- models ----------------------------------------------------------------------
    def _models(self, case: Case):
        self._check_case_device(case)
        dtype = DTYPES[case.dtype]
        tkey = (case.target, case.dtype, case.weights_dtype)
        if tkey not in self._targets:
            self._targets[tkey] = self._load_target(case)
        target = self._targets[tkey]
        # a streamed float64 target holds no weights: the draft shares the source's (the same values: the
        # loaded tensors, or views of the checkpoint's files)
        stream = self._streams.get(tkey)
        embed_w = (
            stream.source_weight(target.get_input_embeddings()) if stream else target.get_input_embeddings().weight
        )
        head_w = (
            stream.source_weight(target.get_output_embeddings()) if stream else target.get_output_embeddings().weight
        )
        draft = self.draft_path(case)
        dkey = (draft, case.target, case.dtype, case.weights_dtype)
        if dkey not in self._drafts:
            # the draft loads on the CPU (its checkpoint's tensors are there), the target's shared weights
            # copied back for it on a GPU (on the CPU .to is the very tensor), then moves as a whole
            # beside a streamed target (on the CPU) the float64 draft never makes its embedding table: the
            # rows are looked up from the files (a model moved to a GPU cannot carry a meta table: there
            # it is dropped after the move)
            rows = self._draft_embedding_source(draft, stream) if stream and self.device == placement.CPU else None
            self._drafts[dkey] = load_draft(
                draft,
                target_embed=None if embed_w is None else embed_w.detach().to(placement.CPU),
                target_lm_head=None if head_w is None else head_w.detach().to(placement.CPU),
                dtype=dtype,
                lookup_embedding=rows is not None,
            )
            self._place(rounded_through(self._drafts[dkey].model, case.weights_dtype))
            self._trained_flags[dkey] = {f: getattr(self._drafts[dkey].config, f) for f in OVERRIDABLE_FLAGS}
            if stream is not None:
                self._stream_draft_embedding(case, draft, self._drafts[dkey], stream, rows)
        loaded = self._drafts[dkey]
        self._apply_overrides(loaded, case, self._trained_flags[dkey])
        if loaded.config.vocab_size != target.config.vocab_size:
            raise ConfigError(
                f"{draft}: draft vocab_size {loaded.config.vocab_size} != target vocab_size {target.config.vocab_size}"
            )
        if loaded.config.target_hidden_size != target.config.hidden_size:
            raise ConfigError(
                f"{draft}: target_hidden_size {loaded.config.target_hidden_size} != target hidden_size "
                f"{target.config.hidden_size}"
            )
        return target, loaded

    @staticmethod
    def _draft_embedding_source(draft: str, stream: StreamedTarget) -> torch.Tensor | None:
        """Where the float64 draft beside a streamed target looks its embedding rows up: the draft's
        checkpoint file (memory-mapped: the stored values, which the float64 copy holds exactly), or
        where it stores none the target's source it shares them with; None for a draft stored wider
        than float32 (it keeps its table)."""
        if streamable(draft) is not None:
            return None
        files = Mapped(draft)
        stored = [n for n in files.names() if canonical_key(n) == "embed_tokens.weight"]
        if not stored:
            return stream.source_weight(stream.model.get_input_embeddings())
        return files.tensor(stored[0]) if len(stored) == 1 else None

    def _stream_draft_embedding(
        self, case: Case, draft: str, loaded: LoadedDraft, stream: StreamedTarget, rows: torch.Tensor | None
    ) -> None:
        """The float64 draft's embedding looked up by rows (`rows`: the table they come from, found
        before the load) instead of a float64 table (a vocabulary wide: 4.2 GB at the Llama-3.1-8B shape)."""
        src = rows if rows is not None else self._draft_embedding_source(draft, stream)
        embed = getattr(loaded.model, "embed_tokens", None)
        if src is not None and isinstance(embed, torch.nn.Embedding):
            stream.stream_embedding(embed, src, DTYPES[case.weights_dtype] if case.weights_dtype else None)

    def _load_target(self, case: Case) -> torch.nn.Module:
        """The target in the case's dtype; the float64 calibration run streamed from the model in the
        weights' dtype (the case's own, loaded once for both) when the checkpoint allows it."""
        tkey = (case.target, case.dtype, case.weights_dtype)
        if case.dtype == DType.FLOAT64 and self.STREAM_FLOAT64:
            why = streamable(case.target)
            if why is None:
                source_dtype = case.weights_dtype or DType.FLOAT32
                skey = (case.target, source_dtype, None)
                rounding = DTYPES[case.weights_dtype] if case.weights_dtype else None
                stream, source = None, f"the {source_dtype} load"
                if skey not in self._targets and self.device == placement.CPU and self.STREAM_FROM_FILES:
                    # the case's own load is not held here (a fresh worker, the plan's): read the
                    # checkpoint's files, not a load of the whole target in the weights' dtype
                    try:
                        stream = StreamedTarget.from_checkpoint(case.target, rounding)
                        source = "the checkpoint's safetensors files (memory-mapped)"
                    except NotStreamable as e:
                        source = f"the {source_dtype} load (the files could not be read as the model: {e})"
                if stream is None and skey not in self._targets:
                    self._targets[skey] = self._place(load_target(case.target, DTYPES[source_dtype]))
                try:
                    stream = stream or StreamedTarget(self._targets[skey], rounding)
                except NotStreamable as e:
                    why = str(e)
                else:
                    self._streams[tkey] = stream
                    self._stream_notes[tkey] = (
                        f"{STREAMED_FLOAT64} from {source} (one decoder layer's weights, or "
                        "the output head's, in float64 at a time)"
                    )
                    return stream.model
            self._stream_notes[tkey] = f"float64 run from a whole float64 copy: cannot stream ({why})"
        return self._place(rounded_through(load_target(case.target, DTYPES[case.dtype]), case.weights_dtype))

    # -- where it runs ---------------------------------------------------------------
    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        """A model loaded on the CPU, moved to the worker's device once (on the CPU: untouched)."""
        return model if self.device == placement.CPU else model.to(self.device)

    def _check_case_device(self, case: Case) -> None:
        """The device is the worker's (its info, its cache keys): a case's own `engines.ref.device` that
        differs is refused, not followed for one case and not ignored."""
        asked = self.settings_for(case).device
        if asked != self._asked:
            raise ConfigError(
                f"{case.path}: engines.{self.spec.name}.device: {asked}, but this worker runs on {self.device}; "
                f"the device is the worker's: give it as --engines {self.spec.name}[device={asked}]"
            )

    def _on_device(self, case: Case, run, *args):
        """`run(case, *args)` (the reference's own code) on the worker's device, its models loaded and
        placed first, outside the device context. transformers' MoE experts kernel (torch grouped_mm)
        may refuse a dtype on a GPU: the experts then run as the per-expert loop, the same maths the
        float64 run takes, and every capture's notes say so."""
        target, _ = self._models(case)
        try:
            with placement.running_on(self.device):
                return run(case, *args)
        except (RuntimeError, NotImplementedError) as e:
            if (
                self.device == placement.CPU
                or "grouped_mm" not in str(e)
                or not hasattr(target, "set_experts_implementation")
            ):
                raise
            target.set_experts_implementation("eager")
            self._fallbacks.append(
                f"{self.spec.id}: torch grouped_mm failed on {self.device} ({str(e).splitlines()[0][:120]}); "
                "MoE experts run as the per-expert loop"
            )
            with placement.running_on(self.device):
                return run(case, *args)

    def draft_path(self, case: Case) -> str:
        """The draft the reference runs: `engines.ref.draft` (the checkpoint as trained, when the case's
        draft is the export the engines serve, e.g. one that lost its lm_head), else the case's."""
        return str(self.settings_for(case).draft or case.draft)

    def _apply_overrides(self, loaded: LoadedDraft, case: Case, trained: dict[str, bool]) -> None:
        """The case's flag overrides on the cached draft, every flag reset to the checkpoint's first (the
        draft is shared by the cases of one worker; the flags are read at run time by Eagle3Draft)."""
        s = self.settings_for(case)
        # EAGLE-3.1's fc norms carry weights: an engine can ignore them (false), not invent them (true)
        weights = {
            "norm_before_fc": getattr(loaded.model, "input_norm", None),
            "fc_norm": getattr(loaded.model, "fc_norm", None),
        }
        for flag in OVERRIDABLE_FLAGS:
            if getattr(s, flag) and flag in weights and weights[flag] is None:
                raise ConfigError(
                    f"{self.spec.id}: {flag}=true, but {self.draft_path(case)} has no {flag} weights "
                    "(the draft was not trained with it)"
                )
            setattr(loaded.config, flag, trained[flag] if getattr(s, flag) is None else getattr(s, flag))
        if s.d2t == "identity":
            loaded.model.d2t.zero_()

    def wiring(self, case: Case, loaded: LoadedDraft, L: int) -> Wiring:
        s = self.settings_for(case)
        if s.wiring is not None:
            choice = s.wiring
            spec_given = any(k == "wiring" for k, _ in self.spec.params)
            where = (
                f"--engines {self.spec.id}: wiring" if spec_given else f"{case.path}: engines.{self.spec.name}.wiring"
            )
        else:
            choice, where = case.wiring, f"{case.path}: wiring"
        ids, src = trained_layer_ids(
            case.layer_ids, loaded.config.layer_ids_eagle_config, loaded.config.layer_ids_top, s.layer_ids
        )
        wiring = resolve(choice, L, ids, where=where, ids_source=src)
        if len(wiring.inputs) != loaded.config.num_aux:
            raise ConfigError(
                f"{where}: wiring {wiring.short()} has {len(wiring.inputs)} inputs but {self.draft_path(case)} fc expects "
                f"{loaded.config.num_aux} x {loaded.config.target_hidden_size} (in_features "
                f"{loaded.config.num_aux * loaded.config.target_hidden_size})"
            )
        return wiring

    # -- the interface ---------------------------------------------------------------
    @emulated  # ref[matmul=tf32|bf16] (matmul_precision.py)
    def capture(self, case: Case, prompt_ids: list[int]) -> Capture:
        capture = self._on_device(case, self._capture, prompt_ids)
        capture.tensors = placement.to_host(capture.tensors, self.device)
        return capture

    def capture_draft_from(self, case: Case, prompt_ids: list[int], fc_in: torch.Tensor) -> Capture:
        """Golden inputs: this engine's draft on the given fc_in ([n, A*H]); the target runs only
        for its greedy next token (the draft's last input token)."""
        capture = self._on_device(case, self._capture_draft_from, prompt_ids, fc_in.to(self.device))
        capture.tensors = placement.to_host(capture.tensors, self.device)
        return capture

    def speculate(self, case: Case, prompts: list[list[int]], num_steps: int, max_new_tokens: int) -> AcceptStats:
        stats = self._on_device(case, self._speculate, prompts, num_steps, max_new_tokens)
        if self._fallbacks:
            stats.source += "; " + "; ".join(self._fallbacks)
        return stats

    def replay(
        self, case: Case, requests: list[tuple[list[int], list[int]]], num_steps: int, topk: int, num_draft_tokens: int
    ) -> list[ReplayRow]:
        """Per request (prompt, output): the acceptance this draft predicts on those very tokens
        (difftest_engines/ref/replay.py), with the number of output tokens its target would have chosen otherwise."""
        return self._on_device(case, self._replay, requests, num_steps, topk, num_draft_tokens)

    @torch.no_grad()
    def _capture(self, case: Case, prompt_ids: list[int]) -> Capture:
        target, loaded = self._models(case)
        L = num_layers(target)
        wiring = self.wiring(case, loaded, L)
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        out = run_target(target, ids)
        next_token = int(out.logits[0, -1].argmax())
        tensors: dict[str, torch.Tensor] = {hidden_name(k): h[0] for k, h in enumerate(out.hidden)}
        tensors[FINAL_NORM] = out.final_norm[0]
        tensors[TARGET_LOGITS] = out.logits[0]
        for k, (scores, margin, experts) in (out.routers or {}).items():  # MoE routing (difftest.compare.noise)
            tensors[f"aux.router.{k}.scores"], tensors[f"aux.router.{k}.margin"] = scores, margin
            tensors[f"aux.router.{k}.experts"] = experts
        fc_in = gather_fc_in(out, wiring.inputs)
        draft_tensors, drafted = capture_draft_chain(loaded.model, fc_in, prompt_ids, next_token, case.num_steps)
        tensors.update(draft_tensors)
        cfg = loaded.config
        meta = CaptureMeta(
            engine=self.spec.id,
            engine_version=self.info().version,
            versions=self.info().versions,
            kernels="torch",
            device=self.device,
            dtype=case.dtype,
            prompt_ids=list(prompt_ids),
            target_next_token=next_token,
            draft_tokens=list(drafted),
            num_layers=L,
            target_hidden_size=cfg.target_hidden_size,
            wiring=wiring,
            draft_config={
                "format": cfg.format,
                "norm_before_fc": cfg.norm_before_fc,
                "fc_norm": cfg.fc_norm,
                "norm_before_residual": cfg.norm_before_residual,
                "norm_output": cfg.norm_output,
                "layer_ids_top": cfg.layer_ids_top,
                "layer_ids_eagle_config": cfg.layer_ids_eagle_config,
                "draft_vocab_size": cfg.draft_vocab_size,
                "shared_from_target": loaded.shared,
            },
            notes=list(loaded.notes) + self._float64_notes(case) + self._device_notes(),
        )
        return Capture(tensors, meta)

    @emulated  # ref[matmul=tf32|bf16] (matmul_precision.py)
    @torch.no_grad()
    def _capture_draft_from(self, case: Case, prompt_ids: list[int], fc_in: torch.Tensor) -> Capture:
        target, loaded = self._models(case)
        width = loaded.config.num_aux * loaded.config.target_hidden_size
        if fc_in.dim() != 2 or fc_in.shape != (len(prompt_ids), width):
            raise ConfigError(f"golden fc_in has shape {list(fc_in.shape)}, expected [{len(prompt_ids)}, {width}]")
        out = run_target(target, torch.tensor([prompt_ids], dtype=torch.long))
        next_token = int(out.logits[0, -1].argmax())
        # the reference captured fc_in in the case's dtype already, so the cast changes nothing
        fc = fc_in.to(DTYPES[case.dtype])[None]
        tensors, drafted = capture_draft_chain(loaded.model, fc, prompt_ids, next_token, case.num_steps)
        meta = CaptureMeta(
            engine=self.spec.id,
            dtype=case.dtype,
            prompt_ids=list(prompt_ids),
            draft_tokens=list(drafted),
            target_hidden_size=loaded.config.target_hidden_size,
            extra={"golden_input": f"reference {FC_IN}"},
        )
        return Capture(tensors, meta)

    @emulated  # ref[matmul=tf32|bf16] (matmul_precision.py)
    @torch.no_grad()
    def _speculate(self, case: Case, prompts: list[list[int]], num_steps: int, max_new_tokens: int) -> AcceptStats:
        target, loaded = self._models(case)
        wiring = self.wiring(case, loaded, num_layers(target))
        topk, budget = self._tree_settings(case, num_steps)
        if topk > 1 or budget != num_steps + 1:
            from difftest_engines.ref.tree import simulate_tree

            stats, _ = simulate_tree(
                target, loaded.model, wiring.inputs, prompts, num_steps, max_new_tokens, topk, budget
            )
            stats.source = f"ref tree simulation (topk {topk}, num_draft_tokens {budget}), wiring {wiring.short()}"
        else:
            stats, _ = simulate_greedy(target, loaded.model, wiring.inputs, prompts, num_steps, max_new_tokens)
            stats.source = f"ref simulation, wiring {wiring.short()}"
        if (case.target, case.dtype, case.weights_dtype) in self._streams:
            stats.source += f", {STREAMED_FLOAT64}"
        return stats

    @emulated  # ref[matmul=tf32|bf16] (matmul_precision.py)
    @torch.no_grad()
    def _replay(
        self, case: Case, requests: list[tuple[list[int], list[int]]], num_steps: int, topk: int, num_draft_tokens: int
    ) -> list[ReplayRow]:
        from difftest_engines.ref.replay import replay_request

        target, loaded = self._models(case)
        wiring = self.wiring(case, loaded, num_layers(target))
        out = []
        for prompt, output in requests:
            r = replay_request(target, loaded.model, wiring.inputs, prompt, output, num_steps, topk, num_draft_tokens)
            r.stats.source = (
                f"ref replay of the server's tokens (wiring {wiring.short()}, topk {topk}, "
                f"num_draft_tokens {num_draft_tokens})"
            )
            out.append(ReplayRow(r.stats, r.target_mismatches, r.first_mismatch))
        return out

    def _tree_settings(self, case: Case, num_steps: int) -> tuple[int, int]:
        """topk and num_draft_tokens (root included, as SGLang counts); a chain by default."""
        s = self.settings_for(case)
        topk, budget = s.topk, s.num_draft_tokens
        if budget is None:
            budget = num_steps + 1 if topk == 1 else topk * num_steps + 1
        return topk, budget

    def _device_notes(self) -> list[str]:
        """On a GPU: the device, TF32 when the user's settings allow it (never set by difftest), fallbacks."""
        if self._precision is None:
            return []
        notes = [f"ran on {placement.describe(self.device, self._precision).removeprefix('torch on ')}"]
        if placement.tf32(self._precision):
            notes.append(
                "float32 matmuls may use TF32 (the worker's torch settings allow it; difftest never changes them): "
                "about 1e-4 relative error, far above a float32 noise floor"
            )
        return notes + self._fallbacks

    def _float64_notes(self, case: Case) -> list[str]:
        note = self._stream_notes.get((case.target, case.dtype, case.weights_dtype))
        return [note] if note else []

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self._targets.clear()
        self._drafts.clear()
        if self.device != placement.CPU:
            torch.cuda.empty_cache()
