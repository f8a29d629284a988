"""Run SpecForge's own hidden-state writer, scripts/prepare_hidden_states.py, on a CPU (one process).

usage: specforge_prepare_hs.py SCRIPT WORKDIR TEMPLATES -- ARGS...   (ARGS: the script's own flags)

Runs in the `specforge-writer` environment (SpecForge 0.2.0 + SGLang 0.5.14, scripts/setup-engine
specforge-writer). SCRIPT is SpecForge's scripts/prepare_hidden_states.py (not in the wheel: a
SpecForge checkout's). It is copied unmodified into WORKDIR/scripts/ and run from there as __main__,
because it puts its dataset cache beside itself (`<script>/../../cache/hf_dataset`). TEMPLATES is
a JSON file {name: ChatTemplate fields} registered in SpecForge's TEMPLATE_REGISTRY first, as its
docs tell users of a custom chat template to do (specforge/data/template.py), or "-".

The CPU stand-ins are specforge_cpu.cpu_process's (applied in this process at run time; nothing
installed and nothing in the script edited).
"""

from __future__ import annotations

import runpy
import shutil
import sys
from pathlib import Path

from specforge_cpu import cpu_process, register_templates


def main(argv: list[str]) -> int:
    script, work, templates, sep, *args = argv
    assert sep == "--", "usage: specforge_prepare_hs.py SCRIPT WORKDIR TEMPLATES -- ARGS..."
    cpu_process()
    register_templates(templates)
    copy = Path(work) / "scripts" / "prepare_hidden_states.py"
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(script, copy)
    sys.argv = [str(copy), *args]
    runpy.run_path(str(copy), run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
