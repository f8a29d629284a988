"""Run a vLLM release's own config-resolution code on draft/target configs, without its engine.

    python -m difftest_engines.vllm.release_probe [--release-root DIR] < pairs.json > readings.json

runs under vLLM's interpreter (its torch, transformers, pydantic). With `--release-root`, DIR holds the
Python sources of another release's wheel (`vllm/**.py`, unpacked by difftest_engines/vllm/preview.py) and is put
first on sys.path, so `import vllm` is that release: a CUDA-only build (0.33.0, 0.34.0) answers on a CPU
machine because nothing here reaches its compiled ops (`vllm._C` is never imported by these modules).
Without it, the installed release answers (the pinned one, as a side-by-side baseline).

Per (target, draft) pair, what the release itself computes, each with the function that computed it:
  * the draft's hf_config as vLLM loads it (`transformers_utils/config.py::get_config`, which converts a
    speculators-format config) wrapped as the speculative config does for EAGLE-3
    (`transformers_utils/configs/eagle.py::EAGLEConfig(..., method="eagle3")`);
  * the aux layer ids per runner: V2 `v1/worker/gpu/spec_decode/eagle/eagle3_utils.py::
    get_eagle3_aux_layers_from_config`, V1 `v1/worker/gpu_model_runner.py::GPUModelRunner.
    _get_eagle3_aux_layers_from_config` where the release has it, and the defaults
    `model_executor/models/interfaces.py::SupportsEagle3.get_eagle3_default_aux_hidden_state_layers`;
  * whether the draft is fed aux hidden states at all (`v1/worker/gpu/spec_decode/eagle/config.py::
    Eagle3SpeculatorConfig.uses_aux_hidden_states`, 0.34; V1 `v1/spec_decode/llm_base_proposer.py`);
  * the draft's max_position_embeddings after `config/speculative.py::SpeculativeConfig.
    _maybe_override_draft_max_position_embeddings` against the target's length.
  * the draft's flags as that loading leaves them (top level and eagle_config).
Which of those flags the draft's model class then reads, and d2t, are decided at its construction, which
needs a whole engine config: not run here (said in each reading as `not_run`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import types

FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual", "use_aux_hidden_state")
NOT_RUN = (
    "which flags the draft model reads (model_executor/models/llama_eagle3.py::LlamaModel.__init__) and d2t "
    "loading (Eagle3LlamaForCausalLM.load_weights) need the model built with a whole engine config"
)


def _stub(hf_config):
    """What the runners read: speculative_config.draft_model_config.hf_config."""
    return types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=hf_config))


def _call(readings: dict, key: str, source: str, fn) -> None:
    try:
        readings[key] = {"value": fn(), "source": source}
    except Exception as e:  # one reading's failure is reported as its own, the others still answer
        readings[key] = {
            "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
            "source": source,
        }


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def probe(target: str, draft: str) -> dict:
    from vllm.config import SpeculativeConfig
    from vllm.model_executor.models.interfaces import SupportsEagle3
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    out: dict = {"not_run": NOT_RUN}
    target_hf = get_config(target, trust_remote_code=False)
    text = target_hf.get_text_config() if hasattr(target_hf, "get_text_config") else target_hf
    L = int(text.num_hidden_layers)
    draft_hf = get_config(draft, trust_remote_code=False)
    wrapped = EAGLEConfig(draft_hf, method="eagle3", model_type="eagle")
    spec = _stub(wrapped)
    out["num_layers"] = L
    holder = types.SimpleNamespace(model=types.SimpleNamespace(layers=[None] * L))
    _call(
        out,
        "defaults",
        "model_executor/models/interfaces.py::SupportsEagle3.get_eagle3_default_aux_hidden_state_layers",
        lambda: _plain(SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(holder)),
    )
    try:
        from vllm.v1.worker.gpu.spec_decode.eagle import eagle3_utils

        _call(
            out,
            "ids_v2",
            "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py::get_eagle3_aux_layers_from_config",
            lambda: _plain(eagle3_utils.get_eagle3_aux_layers_from_config(spec)),
        )
    except ImportError as e:
        out["ids_v2"] = {"absent": f"no Model Runner V2 EAGLE-3 in this release ({e})"}
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        _call(
            out,
            "ids_v1",
            "v1/worker/gpu_model_runner.py::GPUModelRunner._get_eagle3_aux_layers_from_config",
            lambda: _plain(
                GPUModelRunner._get_eagle3_aux_layers_from_config(types.SimpleNamespace(speculative_config=spec))
            ),
        )
    except ImportError:
        out["ids_v1"] = {"absent": "no Model Runner V1 in this release (v1/worker/gpu_model_runner.py is gone)"}
    try:
        from vllm.v1.worker.gpu.spec_decode.eagle.config import Eagle3SpeculatorConfig

        uses = Eagle3SpeculatorConfig.uses_aux_hidden_states.fget  # a property of the speculator config
        _call(
            out,
            "uses_aux_v2",
            "v1/worker/gpu/spec_decode/eagle/config.py::Eagle3SpeculatorConfig.uses_aux_hidden_states",
            lambda: bool(uses(types.SimpleNamespace(spec_config=spec))),
        )
    except (ImportError, AttributeError):
        out["uses_aux_v2"] = {
            "value": True,
            "source": "v1/worker/gpu/model_runner.py (method eagle3: aux hidden states always)",
        }
    # the draft's flags as the release's own config loading leaves them (a speculators-format config is
    # converted there: transformers_utils/configs/speculators/algos.py::update_eagle3, which is where
    # vllm#38111 and vllm#46488 changed what reaches the model)
    eagle_cfg = getattr(draft_hf, "eagle_config", None) or {}
    out["flags"] = {
        "value": {
            flag: {"top level": getattr(draft_hf, flag, None), "eagle_config": eagle_cfg.get(flag)}
            for flag in FLAGS
            if getattr(draft_hf, flag, None) is not None or flag in eagle_cfg
        },
        "source": "transformers_utils/config.py::get_config (speculators configs: configs/speculators/algos.py::update_eagle3)",
    }
    target_len = int(getattr(text, "max_position_embeddings", 0) or 0)
    before = getattr(wrapped, "max_position_embeddings", None)

    def rope_length():
        SpeculativeConfig._maybe_override_draft_max_position_embeddings(wrapped, target_len)
        return {"draft": before, "target": target_len, "after": getattr(wrapped, "max_position_embeddings", None)}

    _call(
        out,
        "draft_length",
        "config/speculative.py::SpeculativeConfig._maybe_override_draft_max_position_embeddings",
        rope_length,
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m difftest_engines.vllm.release_probe")
    parser.add_argument(
        "--release-root", help="a release's unpacked Python sources, imported instead of the installed vllm"
    )
    args = parser.parse_args()
    if args.release_root:
        sys.path.insert(0, args.release_root)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pairs = json.load(sys.stdin)
    import vllm

    result: dict = {"version": getattr(vllm, "__version__", "?"), "module": vllm.__file__, "readings": []}
    for pair in pairs:
        try:
            result["readings"].append(probe(pair["target"], pair["draft"]))
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            result["readings"].append({"error": f"{type(e).__name__}: {first}"})
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
