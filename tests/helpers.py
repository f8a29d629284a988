"""Small builders shared by the harness's tests: tiny random checkpoints and subprocess runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from difftest.records.check_result import CheckResult
from difftest.records.report import Report

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


# A two-prompt case over the tiny random pair of make_tiny_pair (format with target=, draft=).
TINY_CASE = """\
target: {target}
draft: {draft}
wiring: vllm
prompts:
  - ids: [1, 5, 9, 33, 77, 101, 7]
  - ids: [4, 8, 15, 16, 23, 42]
speculative: {{num_steps: 3, max_new_tokens: 8}}
"""

# A case for acceptance counters over make_degenerate_pair (format with target=, draft=, k=, extra=).
COUNTERS_CASE = """\
target: {target}
draft: {draft}
wiring: vllm
prompts:
  - ids: [1, 5, 9, 33, 77, 101, 7]
speculative:
  num_steps: {k}
  max_new_tokens: 24
  prompts:
    - ids: [1, 5, 9, 33, 77, 101, 7]
    - ids: [4, 8, 15, 16, 23, 42]
{extra}"""


def one_line(e: pytest.ExceptionInfo) -> str:
    """The refused input's message, asserted to be what a user reads: one line, no traceback."""
    message = str(e.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A seeded standard-normal tensor in `dtype`, the same for a seed whatever ran before."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fixture_path(name: str) -> Path:
    """The built folder a case's `fixture:NAME` names (resolved as a case run resolves it)."""
    from difftest.run.case_run import resolve_fixture

    return Path(resolve_fixture(name))


def sglang_python_or_skip() -> str:
    """SGLang's interpreter; skips (fails under DIFFTEST_REQUIRE_ENGINES=1) naming the setup command
    when its environment is not built."""

    from difftest.base.paths import cache_root

    python = cache_root() / "envs" / "sglang" / "bin" / "python"
    if not python.exists():
        msg = f"SGLang's environment is not set up ({python} missing); set it up with: scripts/setup-engine sglang"
        if os.environ.get("DIFFTEST_REQUIRE_ENGINES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return str(python)


def make_tiny_pair(directory: Path, num_layers: int = 6, seed: int = 0) -> tuple[Path, Path]:
    """A random Llama target (vocab 512, H=64) and an untrained EAGLE-3 draft (ids [1, 2, 3], draft vocab 256)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from difftest_engines.ref.eagle3 import Eagle3Config
    from difftest_engines.ref.train import init_draft, save_eagle_format

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    target = LlamaForCausalLM(cfg)
    target.save_pretrained(directory / "target")
    dcfg = Eagle3Config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        draft_vocab_size=256,
        target_hidden_size=64,
        num_aux=3,
    )
    draft = init_draft(target, dcfg, torch.arange(256), seed=seed + 1)
    save_eagle_format(draft, directory / "draft", [1, 2, 3])
    return directory / "target", directory / "draft"


def make_degenerate_pair(directory: Path, right: bool) -> tuple[Path, Path]:
    """Target logits are all 0 (final norm weight 0), so greedy always picks token 0. The draft's
    logits are all 0 too, so it proposes its lowest target id: 0 (always right) or 1 (always wrong)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from difftest_engines.ref.eagle3 import Eagle3Config
    from difftest_engines.ref.train import init_draft, save_eagle_format

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    )
    target = LlamaForCausalLM(cfg)
    with torch.no_grad():
        target.model.norm.weight.zero_()
    target.save_pretrained(directory / "target")
    dcfg = Eagle3Config(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
        draft_vocab_size=256,
        target_hidden_size=128,
        num_aux=3,
    )
    d2t = torch.arange(256) + (0 if right else 1)  # draft id d -> target id 2d (right) or 2d + 1 (wrong)
    draft = init_draft(target, dcfg, d2t, seed=1)
    with torch.no_grad():
        draft.norm.weight.zero_()
    save_eagle_format(draft, directory / "draft", [1, 2, 3])
    return directory / "target", directory / "draft"


@dataclass
class Run:
    returncode: int
    output: str
    root: Path
    cache: Path | None = None  # the DIFFTEST_CACHE the run used, when a test set one

    def report(self, case: str) -> Report:
        """The case's report as every reader reads it (Report.load: validated, typed), read once
        per version of the file."""
        path = self.root / "reports" / f"{case}.json"
        key = (str(path), path.stat().st_mtime_ns)
        if key not in _REPORTS:
            _REPORTS[key] = Report.load(path)
        return _REPORTS[key]

    def outcome(self, case: str, engine: str, check: str) -> CheckResult:
        result = self.report(case).result(engine, check)
        if result is None:
            raise KeyError(f"{case}: no result for {engine} {check}")
        return result


_REPORTS: dict[tuple[str, int], Report] = {}


def _pytest_command(root: Path, args: tuple[str, ...], env: dict | None) -> tuple[list[str], dict]:
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), environ.get("PYTHONPATH", "")])
    environ["DIFFTEST_ENGINES"] = "fake=fake_engine:FakeEngine"
    environ["PYTHONUNBUFFERED"] = "1"  # progress lines reach the pipe as they happen (hang_report)
    environ.update(env or {})
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "difftest.plugin",
        "-p",
        "no:cacheprovider",
        "-rfEs",
        "--rootdir",
        str(root),
        "-c",
        os.devnull,
        *args,
    ]
    return command, environ


# Only a hang reaches this: a cold fixture build on a busy 2-core machine takes minutes, and
# `scripts/test` builds the fixtures before the suite (`difftest fixtures`) so no run pays for it.
HANG_GUARD_S = 3600.0


def hang_report(args: tuple[str, ...], timeout: float, output: str) -> str:
    """Which step a run was on when it was stopped: its last `[difftest]` progress lines."""
    steps = [ln for ln in output.splitlines() if ln.startswith("[difftest]")]
    last = "\n  ".join(steps[-3:]) or "(no difftest step started: collection or a fixture build)"
    return (
        f"pytest {' '.join(args)} still running after {timeout:.0f}s (a hang); its last steps:\n  {last}\n"
        f"output tail:\n{output[-3000:]}"
    )


def run_pytest(root: Path, *args: str, env: dict | None = None, timeout: float = HANG_GUARD_S) -> Run:
    """`pytest cases/ ...` in a fresh process inside `root`, with the fake engine registered. A run
    still going after `timeout` is killed and the test fails naming the step it was on."""
    command, environ = _pytest_command(root, args, env)
    proc = subprocess.Popen(command, cwd=root, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # its engine workers exit with it (difftest.run.worker: die_with_parent)
        output, _ = proc.communicate()
        raise AssertionError(hang_report(args, timeout, output)) from None
    return Run(proc.returncode, output, root)


# Ctrl-C reaches the run as it does from a terminal even where this suite runs with SIGINT ignored (a
# background job of a shell without job control, nohup): an ignored signal stays ignored across exec,
# and Python then installs no KeyboardInterrupt handler.
_SIGINT_DEFAULT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


def start_pytest(root: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """As run_pytest, but returns the running process (to interrupt it with SIGINT, as Ctrl-C does)."""
    command, environ = _pytest_command(root, args, env)
    command = [sys.executable, "-c", _SIGINT_DEFAULT, *command]
    return subprocess.Popen(command, cwd=root, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def edited_copy(src: Path, out: Path, config=None, tensors=None) -> Path:
    """A copy of checkpoint `src` at `out`, its config.json edited by `config(cfg)` and its
    safetensors by `tensors(state_dict)`: one fault an exporter or converter makes."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    if config:
        config(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    if tensors:
        f = next(out.glob("*.safetensors"))
        t = load_file(str(f))
        tensors(t)
        save_file(t, str(f))
    return out


def edited_draft(models: tuple[Path, Path], tmp_path: Path, config=None, tensors=None) -> Path:
    """A copy of the tiny pair's draft (`models`: target, draft) at tmp_path/draft, its config.json and
    tensors edited as edited_copy does."""
    return edited_copy(models[1], tmp_path / "draft", config, tensors)


def train_acc(*args: str, json_out: Path) -> tuple[list[dict], str]:
    """`difftest train-acc ARGS --out OUT` in-process: (its JSON rows, what it printed); asserts exit 0."""
    import contextlib
    import io

    from difftest import cli

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        rc = cli.main(["train-acc", *args, "--out", str(json_out)])
    assert rc == 0, text.getvalue()
    return json.loads(json_out.read_text())["rows"], text.getvalue()
