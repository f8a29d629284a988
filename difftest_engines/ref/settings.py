"""The reference engine's settings (difftest.base.settings): the case's `engines.ref` merged with `ref[...]`."""

from difftest.api import MATMUL_PRECISIONS, Schema, Setting, settings_record

# Where the target and draft run (`ref[device=cuda]`): a choice, so that the harness refuses a bad
# value in one line with the closest name before any worker starts. `cuda:N` up to 15: more GPUs than
# any machine of this project holds; a device this machine lacks is refused when the worker starts.
MAX_CUDA_INDEX = 15
DEVICES = ("cpu", "cuda", *(f"cuda:{i}" for i in range(MAX_CUDA_INDEX + 1)))

SCHEMA = Schema(
    "ref",
    (
        Setting(
            "wiring",
            "wiring",
            "fc inputs: a preset (vllm, sglang, speculators, ...), h0+h3+h31, or [h0, h3, h31]; "
            "default: the case's wiring",
        ),
        Setting(
            "layer_ids",
            "ids",
            "ids the preset reads (spec: 2+4+5); default: the case's layer_ids, else the draft config's",
        ),
        Setting("norm_before_residual", "bool", "override the draft config's flag (a misconfigured engine's draft)"),
        Setting("norm_output", "bool", "override the draft config's flag (a misconfigured engine's draft)"),
        Setting("norm_before_fc", "bool", "false: ignore the draft's norm_before_fc (an engine that does not read it)"),
        Setting(
            "fc_norm", "bool", "false: ignore the draft's fc_norm / use_aux_norm (an engine that does not read it)"
        ),
        Setting(
            "draft",
            "path",
            "run this draft instead of the case's: the checkpoint as trained, when the case's "
            "draft is an export the engines serve (the catalogue's broken checkpoints)",
            replaces="draft",
        ),
        Setting("d2t", "choice", "identity: drop the draft-to-target vocabulary map", choices=("identity",)),
        Setting(
            "matmul",
            "choice",
            "compute every float32 matmul as this format does (inputs rounded, float32 sums): an engine "
            "on TF32 tensor cores or a bf16 GEMM",
            choices=tuple(MATMUL_PRECISIONS),
        ),
        Setting("topk", "int", "draft tree branching for accept-length simulation (1: a chain)", default=1, min=1),
        Setting("num_draft_tokens", "int", "tree budget, root included (default: num_steps + 1 for a chain)", min=2),
        Setting(
            "device",
            "choice",
            "where the target and draft run, the float64 noise-floor run included when this engine calibrates: "
            "cpu (default), cuda, cuda:N; captures come back on the CPU. The worker's: --engines ref[device=cuda]",
            default="cpu",
            choices=DEVICES,
        ),
    ),
)

# what the adapter reads them as (Engine.settings_for): one attribute per setting
Settings = settings_record(SCHEMA)
