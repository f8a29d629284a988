"""The capture cache follows the checkpoints' contents: a checkpoint rewritten with other weights
but the same size and mtime is captured afresh, never served from the cache (difftest.base.content_digest)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from difftest.case.case import load_case
from difftest.base.content_digest import paths_signature, signature
from helpers import TINY_CASE, run_pytest


def rewrite_keeping_size_and_times(checkpoint: Path) -> None:
    """New weights in every safetensors file of `checkpoint`, same size, same atime/mtime. The
    embedding is kept: a draft embedding unlike the target's is a lint error of its own
    (embedding-substituted), and this test is about the cache, not the lint."""
    for f in checkpoint.glob("*.safetensors"):
        st = f.stat()
        tensors = {k: v + 1 if v.is_floating_point() and "embed" not in k else v for k, v in load_file(str(f)).items()}
        save_file(tensors, str(f), metadata={"format": "pt"})
        assert f.stat().st_size == st.st_size
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert f.stat().st_mtime_ns == st.st_mtime_ns


def tiny_case_project(root: Path, target: Path, draft: Path) -> Path:
    (root / "cases").mkdir(parents=True)
    (root / "cases" / "tiny.yaml").write_text(TINY_CASE.format(target=target, draft=draft))
    return root


def test_case_fingerprint_changes_when_weights_change_under_the_same_size_and_mtime(models, tmp_path):
    import shutil

    target, draft = models
    own_draft = tmp_path / "draft"
    shutil.copytree(draft, own_draft)
    case = load_case(tiny_case_project(tmp_path / "p", target, own_draft) / "cases" / "tiny.yaml")
    before = case.fingerprint()
    assert case.fingerprint() == before  # stable while nothing changes
    rewrite_keeping_size_and_times(own_draft)
    assert case.fingerprint() != before


def test_signature_of_a_data_directory_covers_nested_files_by_content(tmp_path):
    (tmp_path / "d" / "hidden_states").mkdir(parents=True)
    f = tmp_path / "d" / "hidden_states" / "hs_0.safetensors"
    save_file({"x": torch.zeros(4)}, str(f))
    before = paths_signature({"params": {"data": str(tmp_path / "d")}})
    st = f.stat()
    save_file({"x": torch.ones(4)}, str(f))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert paths_signature({"params": {"data": str(tmp_path / "d")}}) != before
    assert signature(tmp_path / "no-such-path") == [str(tmp_path / "no-such-path")]


def test_rewritten_checkpoint_with_same_size_and_mtime_is_captured_again(models, tmp_path):
    import shutil

    target, draft = models
    own_draft = tmp_path / "draft"
    shutil.copytree(draft, own_draft)
    root, env = tiny_case_project(tmp_path / "p", target, own_draft), {"DIFFTEST_CACHE": str(tmp_path / "cache")}
    first = run_pytest(root, "cases/", "--engines=ref", "--out=r1", env=env)
    rewrite_keeping_size_and_times(own_draft)
    second = run_pytest(root, "cases/", "--engines=ref", "--out=r2", env=env)
    assert first.returncode == second.returncode == 0, second.output
    assert "request capture" in (root / "r1" / "logs" / "ref.log").read_text()
    assert "request capture" in (root / "r2" / "logs" / "ref.log").read_text(), "a stale cached capture was reused"
