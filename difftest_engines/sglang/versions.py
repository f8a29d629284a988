"""What changed between SGLang releases on the EAGLE-3 path, as data the adapter keys on.

Every entry was read in the released wheels' own code (`pip download --no-deps sglang==X`),
not inferred from dates; docs/sglang-releases.md has the per-release table and the evidence.
Plain Python, no SGLang import: `version` is the installed SGLang's `__version__`.

The layer-id and flag rules of each release are difftest.rules.engine_releases (the pinned ones,
difftest.rules.layer_rules and difftest.rules.draft_rules, with the changes read in the wheels undone); this
module holds what only the adapter needs: which releases run here, and their CPU path's defects.
"""

from __future__ import annotations

import re

# What the adapter itself must know per release (the rules engines apply to a draft, which
# layers reach fc and which flags are read, are difftest.rules.engine_releases: one copy, cited there).
CPU_DRAFT_DECODE_SEQ_LENS_FIXED = (
    0,
    5,
    19,
)  # layers/attention/intel_amx_backend.py::IntelAMXAttnBackend.forward_decode:
#   0.5.16-0.5.18 overwrite the draft-decode seq_lens (IntelAMXMultiStepDraftBackend's expanded lengths,
#   prefix + step + 1) with forward_batch.seq_lens right after choosing them, so every draft-decode step
#   attends over the committed prefix only (its own and earlier draft tokens' k/v unseen)
CPU_EAGLE = (0, 5, 16)  # speculative/draft_utils.py::DraftBackendFactory gains intel_amx draft backends, and
#   speculative/eagle_utils.py its CPU tree build / verify: the first release whose EAGLE-3 runs on a CPU


def release(version: str | None) -> tuple[int, ...] | None:
    """'0.5.12.post1' -> (0, 5, 12, 1); '0.5.23+cpu-shim.a2' -> (0, 5, 23); None -> None (the pinned release)."""
    if not version:
        return None
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0]))


def at_least(version: str | None, first: tuple[int, ...]) -> bool:
    v = release(version)
    return v is None or v >= first


def layer_rule(family: str, version: str | None = None):
    """SGLang's layer-id rule for a target family in this release (None: the pinned release's rule):
    difftest.rules.engine_releases derives it from the pinned rule and the changes read in the wheels."""
    from difftest.api import layer_rule as release_rule

    return release_rule("sglang", family, version)


def unsupported_on_cpu(version: str | None) -> str | None:
    """Why this release cannot run EAGLE-3 on a CPU at all, or None."""
    if at_least(version, CPU_EAGLE):
        return None
    return (
        f"SGLang {version} has no CPU EAGLE path: speculative/draft_utils.py::DraftBackendFactory offers no "
        "intel_amx (or other CPU) draft attention backend, and speculative/eagle_utils.py builds and verifies "
        "the draft tree only with CUDA/NPU kernels (verify_tree_greedy_func does nothing on a CPU); the first "
        "release with both is 0.5.16"
    )


def cpu_caveat(version: str | None) -> str | None:
    """A known defect of this release's own CPU EAGLE path that changes what it computes, or None."""
    if at_least(version, CPU_DRAFT_DECODE_SEQ_LENS_FIXED) or not at_least(version, CPU_EAGLE):
        return None
    return (
        f"SGLang {version}'s CPU draft decode attends over the committed prefix only "
        "(layers/attention/intel_amx_backend.py::IntelAMXAttnBackend.forward_decode overwrites the draft "
        "seq_lens with forward_batch.seq_lens; fixed in 0.5.19): draft steps >= 1 and every decode-round "
        "draft token differ from the GPU path; the prefill's fc inputs and draft step 0 are unaffected"
    )
