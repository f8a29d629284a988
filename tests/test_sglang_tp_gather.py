"""difftest_engines/sglang/tensor_parallel.py: each rank's hook records joined into whole tensors by the
sharding rule (no engine: records written as SGLang's hooks write them, one folder per rank).
The rule itself is checked against the real engine in tests/test_engine_sglang_tp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from difftest.base.errors import EngineError
from difftest_engines.sglang import tensor_parallel
from difftest_engines.sglang.rank_crash import crash_cause


def _write(root: Path, rank: int, seq: int, kind: str, record: dict) -> None:
    d = root / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    torch.save({**record, "tp_rank": rank, "tp_size": 2}, d / f"{seq:06d}_{kind}.pt")


def test_vocab_sharded_logits_are_joined_in_rank_order_and_cut_to_the_vocabulary(tmp_path):
    hidden = torch.randn(3, 8)
    weight = torch.randn(1024, 8)  # the padded vocabulary: 1000 real rows, 24 padding
    for r in (0, 1):
        shard = weight[r * 512 : (r + 1) * 512]
        _write(
            tmp_path,
            r,
            0,
            "logits",
            {
                "mode": "EXTEND",
                "hidden": hidden,
                "vocab_size": 1000,
                "all_logits": hidden @ shard.T,
                "next_token_logits": None,
            },
        )
    got = tensor_parallel.gather(str(tmp_path))
    ((kind, rec),) = got.records
    assert got.tp_size == 2 and kind == "logits"
    torch.testing.assert_close(rec["all_logits"], (hidden @ weight.T)[:, :1000])


def test_a_replicated_tensor_that_differs_on_a_rank_names_the_rank_and_the_tensor(tmp_path):
    t = torch.randn(4, 8)
    _write(tmp_path, 0, 0, "embed", {"embeds": t})
    _write(tmp_path, 1, 0, "embed", {"embeds": t + 1e-3})
    with pytest.raises(EngineError, match=r"rank 1's embed.embeds \(record #0\) differs from rank 0's"):
        tensor_parallel.gather(str(tmp_path))


def test_partial_sums_of_an_unreduced_row_parallel_output_are_added(tmp_path):
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    _write(tmp_path, 0, 0, "attn_out", {"t": a, "reduced": False})
    _write(tmp_path, 1, 0, "attn_out", {"t": b, "reduced": False})
    ((_, rec),) = tensor_parallel.gather(str(tmp_path)).records
    torch.testing.assert_close(rec["t"], a + b)


def test_a_column_parallel_fc_output_is_joined_and_a_plain_linear_one_is_checked_equal(tmp_path):
    x = torch.randn(4, 6)
    for r in (0, 1):
        _write(
            tmp_path,
            r,
            0,
            "fc",
            {"fc_in_normed": x, "fc_out": x[:, r * 3 : (r + 1) * 3], "module": "ColumnParallelLinear"},
        )
        _write(tmp_path, r, 1, "fc", {"fc_in_normed": x, "fc_out": x, "module": "Linear"})
    (_, col), (_, whole) = tensor_parallel.gather(str(tmp_path)).records
    assert torch.equal(col["fc_out"], x) and torch.equal(whole["fc_out"], x)


def test_a_tensor_without_a_sharding_rule_is_refused(tmp_path):
    for r in (0, 1):
        _write(tmp_path, r, 0, "embed", {"embeds": torch.zeros(2, 2), "new_tensor": torch.zeros(2)})
    with pytest.raises(EngineError, match=r"no sharding rule for embed.new_tensor"):
        tensor_parallel.gather(str(tmp_path))


def test_ranks_that_recorded_different_forwards_are_refused(tmp_path):
    _write(tmp_path, 0, 0, "embed", {"embeds": torch.zeros(2, 2)})
    _write(tmp_path, 1, 0, "fc", {"fc_in_normed": torch.zeros(2, 2), "fc_out": torch.zeros(2, 2), "module": "Linear"})
    with pytest.raises(EngineError, match=r"rank 1 recorded 1 hook records \(fc\), rank 0 1 \(embed\)"):
        tensor_parallel.gather(str(tmp_path))


def test_capture_meta_says_per_canonical_tensor_what_was_gathered_or_checked():
    how = {
        ("logits", "all_logits", None): tensor_parallel.rule_for("logits", "all_logits", {}),
        ("model", "aux", None): tensor_parallel.rule_for("model", "aux", {}),
    }
    names = ["target.logits", "target.h.3", "draft.logits", "draft.step1.logits_target", "x"]
    said = tensor_parallel.describe(how, 2, names)
    assert said["draft.logits"].startswith("gathered: 2 shards")
    assert said["target.logits"].startswith("gathered: 2 shards joined on the last dimension (")
    assert said["draft.step1.logits_target"].startswith("gathered: 2 shards")
    assert said["target.h.3"].startswith("replicated: rank 0's, checked equal on 2 ranks (")
    assert "x" not in said


def test_every_rule_cites_sglang_code_and_names_a_known_sharding():
    for rule in tensor_parallel.RULES:
        assert rule.how in (tensor_parallel.REPLICATED, tensor_parallel.CONCAT, tensor_parallel.SUM), rule
        assert rule.why, rule


# what SGLang 0.5.23 logged when rank 1's scheduler was SIGKILLed mid-request at tp_size 2
_ECHO_LOG = (
    "[2026-12-02 08:08:37 TP0] Scheduler hit an exception: Traceback (most recent call last):\n"
    "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:10154: Connection reset by peer.\n"
    "[2026-12-02 08:08:38] Subprocess scheduler_0 (pid=21170) crashed with exit code 255. Triggering SIGQUIT\n"
)


def test_a_rank_killed_outright_is_named_with_its_signal_not_the_survivors_echo():
    cause = crash_cause(_ECHO_LOG, {0: (21170, 255), 1: (21171, -9)})
    assert cause == "SGLang's tensor-parallel rank 1 (scheduler pid 21171) died: killed by SIGKILL"


def test_without_exit_codes_the_watchdogs_rank_is_named():
    log = "[2026-12-02 08:00:01] Subprocess scheduler_1 (pid=4242) crashed with exit code -9. Triggering SIGQUIT\n"
    assert crash_cause(log) == "SGLang's tensor-parallel rank 1 (scheduler pid 4242) died: killed by SIGKILL"


def test_a_rank_that_raised_is_named_with_its_own_error():
    log = (
        "[2026-12-02 08:00:01 TP1] Scheduler hit an exception: Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n'
        "ValueError: rank one's own failure\n"
        "[2026-12-02 08:00:01 TP0] Scheduler hit an exception: Traceback (most recent call last):\n"
        "RuntimeError: Connection closed by peer\n"
    )
    cause = crash_cause(log, {0: (10, 255), 1: (11, 1)})
    assert cause == "SGLang's tensor-parallel rank 1 (its scheduler) failed: ValueError: rank one's own failure"
