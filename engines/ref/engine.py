"""The reference engine: a transformers target plus the plain-PyTorch EAGLE-3 draft.

Its wiring is explicit: the engine spec's `wiring` parameter, else the case's
`engines.ref.wiring`, else the case's `wiring` (what the draft was trained on). A preset
translates layer ids (spec `layer_ids=2+4+5`, else the case's `layer_ids`, else the
draft config's) the way that ecosystem does, so `ref[wiring=sglang]` answers "what if
an engine wired this draft like SGLang" without SGLang installed.
"""

from __future__ import annotations

import torch

import difftest
from difftest.acceptance import AcceptStats
from difftest.capture import Capture
from difftest.case import Case
from difftest.engine import Engine, EngineInfo
from difftest.errors import ConfigError
from difftest.names import draft_name
from difftest.wiring import Wiring, resolve
from engines.ref.eagle3 import LoadedDraft, load_draft
from engines.ref.speculate import gather_fc_in, run_draft_chain, simulate_greedy
from engines.ref.target import load_target, num_layers, run_target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RefEngine(Engine):
    def __init__(self, spec):
        super().__init__(spec)
        self._targets: dict[tuple, torch.nn.Module] = {}
        self._drafts: dict[tuple, LoadedDraft] = {}

    def info(self) -> EngineInfo:
        import transformers

        return EngineInfo(
            name="ref",
            version=f"difftest-{difftest.__version__}",
            versions={"torch": torch.__version__, "transformers": transformers.__version__},
            kernels="torch",
        )

    # -- models ----------------------------------------------------------------------
    def _models(self, case: Case):
        dtype = DTYPES[case.dtype]
        tkey = (case.target, case.dtype)
        if tkey not in self._targets:
            self._targets[tkey] = load_target(case.target, dtype)
        target = self._targets[tkey]
        dkey = (case.draft, case.target, case.dtype)
        if dkey not in self._drafts:
            self._drafts[dkey] = load_draft(
                case.draft,
                target_embed=target.get_input_embeddings().weight.detach(),
                target_lm_head=target.get_output_embeddings().weight.detach(),
                dtype=dtype,
            )
        loaded = self._drafts[dkey]
        if loaded.config.vocab_size != target.config.vocab_size:
            raise ConfigError(
                f"{case.draft}: draft vocab_size {loaded.config.vocab_size} != target vocab_size {target.config.vocab_size}"
            )
        if loaded.config.target_hidden_size != target.config.hidden_size:
            raise ConfigError(
                f"{case.draft}: target_hidden_size {loaded.config.target_hidden_size} != target hidden_size "
                f"{target.config.hidden_size}"
            )
        return target, loaded

    def wiring(self, case: Case, loaded: LoadedDraft, L: int) -> Wiring:
        spec_wiring = self.spec.param("wiring")
        if spec_wiring is not None:
            choice, where = spec_wiring, f"--engines {self.spec.id}: wiring"
        elif "wiring" in case.engine_settings("ref"):
            choice, where = case.engine_settings("ref")["wiring"], f"{case.path}: engines.ref.wiring"
        else:
            choice, where = case.wiring, f"{case.path}: wiring"
        spec_ids = self.spec.param("layer_ids")
        if spec_ids is not None:
            try:
                ids, src = [int(x) for x in spec_ids.replace("+", " ").split()], "engine spec"
            except ValueError:
                raise ConfigError(f"--engines {self.spec.id}: layer_ids must look like 2+4+5") from None
        elif case.layer_ids is not None:
            ids, src = case.layer_ids, "case layer_ids"
        else:
            ids = loaded.config.layer_ids
            src = "draft config eagle_config" if loaded.config.layer_ids_eagle_config else "draft config"
        wiring = resolve(choice, L, ids, where=where, ids_source=src)
        if len(wiring.inputs) != loaded.config.num_aux:
            raise ConfigError(
                f"{where}: wiring {wiring.short()} has {len(wiring.inputs)} inputs but {case.draft} fc expects "
                f"{loaded.config.num_aux} x {loaded.config.target_hidden_size} (in_features "
                f"{loaded.config.num_aux * loaded.config.target_hidden_size})"
            )
        return wiring

    # -- the interface ---------------------------------------------------------------
    @torch.no_grad()
    def capture(self, case: Case, prompt_ids: list[int]) -> Capture:
        target, loaded = self._models(case)
        L = num_layers(target)
        wiring = self.wiring(case, loaded, L)
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        out = run_target(target, ids)
        next_token = int(out.logits[0, -1].argmax())
        tensors: dict[str, torch.Tensor] = {f"target.h.{k}": h[0] for k, h in enumerate(out.hidden)}
        tensors["target.final_norm"] = out.final_norm[0]
        tensors["target.logits"] = out.logits[0]
        fc_in = gather_fc_in(out, wiring.inputs)
        tensors["draft.fc_in"] = fc_in[0]

        def record(step: int, name: str, t: torch.Tensor) -> None:
            tensors[draft_name(step, name)] = t[0]

        next_ids = torch.tensor([prompt_ids[1:] + [next_token]], dtype=torch.long)
        drafted = run_draft_chain(loaded.model, fc_in, next_ids, case.num_steps, record)
        cfg = loaded.config
        meta = {
            "engine": self.spec.id,
            "engine_version": self.info().version,
            "versions": self.info().versions,
            "kernels": "torch",
            "device": "cpu",
            "dtype": case.dtype,
            "prompt_ids": list(prompt_ids),
            "target_next_token": next_token,
            "draft_tokens": drafted,
            "num_layers": L,
            "target_hidden_size": cfg.target_hidden_size,
            "wiring": {"inputs": list(wiring.inputs), "source": wiring.source, "verifier": wiring.verifier},
            "draft_config": {
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
            "notes": loaded.notes,
        }
        return Capture(tensors, meta)

    @torch.no_grad()
    def speculate(self, case: Case, prompts: list[list[int]], num_steps: int, max_new_tokens: int) -> AcceptStats:
        target, loaded = self._models(case)
        wiring = self.wiring(case, loaded, num_layers(target))
        stats, _ = simulate_greedy(target, loaded.model, wiring.inputs, prompts, num_steps, max_new_tokens)
        stats.source = f"ref simulation, wiring {wiring.short()}"
        return stats

    def close(self) -> None:
        self._targets.clear()
        self._drafts.clear()

