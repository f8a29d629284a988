"""What an engine start costs in garbage collection: each engine's processes leave the heap that was alive
before the engine (the interpreter's modules, vLLM's, SGLang's, torch's) out of the collector's full passes,
and the previous engine is freed when the next one is built.

vLLM builds each case's engine in the worker itself, calling gc.collect() about ten times on the way
(difftest_engines/vllm/engine.py::_freeze_heap); SGLang's scheduler and detokenizer fork from a server
that has SGLang imported (difftest_engines/sglang/process_start.py, frozen_heap.py). Run in each engine's
own environment, as the worker runs.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from helpers import fixture_path
from test_engine_vllm import vllm_python

ROOT = Path(__file__).resolve().parent.parent

VLLM_SCRIPT = """
import gc, json, sys, weakref
from difftest.case.case import load_case
from difftest.run.engine import parse_spec
from difftest.run.worker import _load_engine
from difftest.base.registry import engine_target

spec = parse_spec("vllm")
engine = _load_engine(engine_target(spec.name), spec)
engine.info()  # the worker's first request (hello)
case = load_case(sys.argv[1])
engine.capture(case, list(case.prompts[0].ids))
first = weakref.ref(engine._llm)

frozen_at_collect = []
real_collect = gc.collect
def recording(*args, **kwargs):
    frozen_at_collect.append(gc.get_freeze_count())
    return real_collect(*args, **kwargs)
gc.collect = recording
engine.speculate(case, [list(case.spec_prompts[0].ids)], 2, 4)  # another num_steps: another engine
gc.collect = real_collect
print(json.dumps({"rebuilt": engine._llm is not None and engine._llm is not first(), "first_alive": first() is not None,
                  "frozen_at_collect": frozen_at_collect}))
engine.close()
"""

SGLANG_SCRIPT = """
import gc, json, multiprocessing

def report(queue):
    queue.put(gc.get_freeze_count())

if __name__ == "__main__":
    from difftest.base.registry import engine_target
    from difftest.run.engine import parse_spec
    from difftest.run.worker import _load_engine
    from difftest_engines.sglang import process_start

    spec = parse_spec("sglang")
    engine = _load_engine(engine_target(spec.name), spec)
    engine._import()  # the environment the adapter's engines start in (CPU kernels, private dirs)
    with process_start.engine_start():
        multiprocessing.set_start_method("spawn", force=True)  # what sglang.Engine asks for
        queue = multiprocessing.Queue()
        child = multiprocessing.Process(target=report, args=(queue,))
        child.start()
        frozen = queue.get(timeout=300)
        child.join()
    print(json.dumps({"method": multiprocessing.get_start_method(), "child_frozen": frozen,
                      "parent_frozen": gc.get_freeze_count()}))
    engine.close()
"""


def _run(python: str, script: str, tmp_path: Path, *args: str) -> dict:
    path = tmp_path / "script.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [python, str(path), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vllm_builds_the_next_engine_with_the_heap_before_it_frozen_and_frees_the_previous_one(tmp_path):
    case = tmp_path / "tiny_llama.yaml"  # the shipped case with its fixtures resolved, as the harness sends it
    lines = (ROOT / "cases" / "tiny_llama.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        key, _, value = line.partition(": ")
        if key in ("target", "draft"):
            lines[i] = f"{key}: {fixture_path(value)}"
    case.write_text("\n".join(lines) + "\n")
    out = _run(vllm_python(), VLLM_SCRIPT, tmp_path, str(case))
    assert out["rebuilt"]
    assert not out["first_alive"], "the previous engine outlived the next one's build"
    # the passes vLLM makes while it builds skip the heap alive before it: hundreds of thousands of
    # objects (the modules); unfrozen by the previous engine's shutdown, every pass would walk them
    during = [n for n in out["frozen_at_collect"] if n > 0]
    assert len(during) >= 5 and min(during) > 100_000, out["frozen_at_collect"]


def test_sglang_engine_processes_fork_from_a_server_whose_heap_is_frozen(tmp_path, sglang_python):
    out = _run(sglang_python, SGLANG_SCRIPT, tmp_path)
    assert out["child_frozen"] > 100_000, out  # SGLang's scheduler module and torch, imported in the server
    assert out["parent_frozen"] == 0, out  # the worker's own heap is left as it was
