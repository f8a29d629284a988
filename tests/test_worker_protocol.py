"""The worker protocol's typed messages (difftest.run.protocol): each request and reply keeps the JSON
line it has always had on the pipe, reads back to the same record, and an unknown op or field is
refused in one line naming it and the closest valid name."""

from __future__ import annotations

import json

import pytest

from difftest.base.errors import ConfigError
from difftest.case.case import Case
from difftest.records.acceptance import AcceptStats
from difftest.records.engine_info import EngineInfo
from difftest.records.timings import WorkerPhase
from difftest.run.engine import EngineSpec
from difftest.run.protocol import (
    CaptureDraftFromRequest,
    CaptureReply,
    CaptureRequest,
    Close,
    CloseReply,
    Failure,
    Hello,
    HelloReply,
    ReplayReply,
    ReplayRequest,
    Request,
    SpeculateReply,
    SpeculateRequest,
)

CASE = Case(name="x", path="x.yaml", target="t", draft="d")
SPEC = EngineSpec("ref", "old", (("wiring", "sglang"),))


def line(wire: dict) -> str:
    return json.dumps(wire)


# Each request beside the dict the harness wrote before the messages were typed: the same line.
REQUESTS = [
    (
        Hello(SPEC, "difftest_engines.ref.engine:RefEngine"),
        {"op": "hello", "spec": SPEC.to_dict(), "target": "difftest_engines.ref.engine:RefEngine"},
    ),
    (
        CaptureRequest(CASE, [1, 2], "/c/out"),
        {"op": "capture", "case": CASE.to_dict(), "prompt_ids": [1, 2], "out": "/c/out"},
    ),
    (
        SpeculateRequest(CASE, [[1, 2], [3]], 3, 16),
        {"op": "speculate", "case": CASE.to_dict(), "prompts": [[1, 2], [3]], "num_steps": 3, "max_new_tokens": 16},
    ),
    (
        CaptureDraftFromRequest(CASE, [1, 2], "/c/fc.safetensors", "/c/out"),
        {
            "op": "capture_draft_from",
            "case": CASE.to_dict(),
            "prompt_ids": [1, 2],
            "fc_in": "/c/fc.safetensors",
            "out": "/c/out",
        },
    ),
    (
        ReplayRequest(CASE, [([1, 2], [5, 6])], 3, 1, 4),
        {
            "op": "replay",
            "case": CASE.to_dict(),
            "requests": [([1, 2], [5, 6])],
            "num_steps": 3,
            "topk": 1,
            "num_draft_tokens": 4,
        },
    ),
    (Close(), {"op": "close"}),
]


@pytest.mark.parametrize("request_, legacy", REQUESTS, ids=[r.OP for r, _ in REQUESTS])
def test_a_request_is_the_line_it_always_was_and_reads_back_to_itself(request_, legacy):
    assert line(request_.to_wire()) == line(legacy)
    back = Request.from_wire(json.loads(line(legacy)))
    assert type(back) is type(request_)
    assert line(back.to_wire()) == line(legacy)
    if isinstance(back, CaptureRequest):
        assert back.case == CASE and back.prompt_ids == [1, 2]
    if isinstance(back, Hello):
        assert back.spec == SPEC


def test_an_unknown_op_is_refused_naming_the_closest():
    with pytest.raises(ConfigError) as e:
        Request.from_wire({"op": "captur", "case": {}})
    assert str(e.value) == (
        "worker request: unknown op 'captur'; did you mean 'capture'? "
        "(known: capture, capture_draft_from, close, hello, replay, speculate)"
    )
    assert "\n" not in str(e.value)


def test_an_unknown_or_missing_field_or_a_wrong_type_is_refused_in_one_line():
    wire = CaptureRequest(CASE, [1], "/o").to_wire()
    with pytest.raises(
        ConfigError, match=r"^worker request: capture\.prompt_idz: unknown field \(did you mean 'prompt_ids'\?\)$"
    ):
        Request.from_wire({**{k: v for k, v in wire.items() if k != "prompt_ids"}, "prompt_idz": [1]})
    with pytest.raises(ConfigError, match=r"^worker request: capture\.out: field missing$"):
        Request.from_wire({k: v for k, v in wire.items() if k != "out"})
    with pytest.raises(
        ConfigError, match=r"^worker request: capture\.prompt_ids\[0\]: expected an integer, got a string$"
    ):
        Request.from_wire({**wire, "prompt_ids": ["1"]})


def test_replies_keep_their_wire_form_and_read_back_typed():
    phases = [WorkerPhase("engine.capture", 1.5), WorkerPhase("transfer.write", 0.5, 10)]
    capture = CaptureReply(phases)
    assert line(capture.to_wire()) == line(
        {
            "ok": True,
            "timings": [
                {"phase": "engine.capture", "seconds": 1.5, "bytes": 0},
                {"phase": "transfer.write", "seconds": 0.5, "bytes": 10},
            ],
        }
    )
    assert CaptureRequest(CASE, [1], "/o").reply_from_wire(capture.to_wire(), "ref") == capture
    stats = AcceptStats(num_verify=4, num_accepted=6, num_draft_steps=3, accepted_per_pos=[3, 2, 1])
    spec_reply = SpeculateRequest(CASE, [[1]], 3, 8).reply_from_wire(SpeculateReply(stats, phases).to_wire(), "ref")
    assert isinstance(spec_reply, SpeculateReply) and spec_reply.stats.to_dict() == stats.to_dict()
    assert spec_reply.timings == phases
    replay = ReplayRequest(CASE, [], 3, 1, 4).reply_from_wire(ReplayReply([], []).to_wire(), "ref")
    assert replay == ReplayReply([], [])
    assert Close().reply_from_wire({"ok": True}, "ref") == CloseReply()
    info = EngineInfo(name="ref", version="1")
    hello = Hello(SPEC, "m:a").reply_from_wire(HelloReply(info).to_wire(), "ref")
    assert isinstance(hello, HelloReply) and hello.info.to_dict() == info.to_dict()


def test_a_failure_reply_keeps_its_wire_form():
    assert line(Failure("config", "bad").to_wire()) == line({"ok": False, "kind": "config", "error": "bad"})
    ends = {"ok": False, "kind": "engine", "error": "spent", "ends": True}
    assert line(Failure("engine", "spent", ends=True).to_wire()) == line(ends)
    assert Close().reply_from_wire(ends, "ref") == Failure("engine", "spent", ends=True)


def test_timings_of_another_version_are_not_counted_but_do_not_fail_the_reply():
    reply = CaptureRequest(CASE, [1], "/o").reply_from_wire({"ok": True, "timings": [{"phase": 3}]}, "ref")
    assert reply == CaptureReply([])


def test_an_engine_reads_its_settings_as_a_record_generated_from_its_schema():
    from dataclasses import asdict, fields

    from difftest.base.settings import Schema, Setting, settings_record
    from difftest.run.engine import Engine

    schema = Schema(
        "demo",
        (
            Setting("topk", "int", "branching", default=1, min=1),
            Setting("wiring", "wiring", "fc inputs"),
            Setting("extra", "mapping", "anything", default={}),
        ),
    )

    class Demo(Engine):
        SETTINGS = schema

        def info(self): ...
        def capture(self, case, prompt_ids): ...
        def speculate(self, case, prompts, num_steps, max_new_tokens): ...

    assert settings_record(schema) is settings_record(schema)  # generated once per schema
    assert [f.name for f in fields(settings_record(schema))] == ["topk", "wiring", "extra"]
    s = Demo(EngineSpec("demo", params=(("topk", "3"),))).settings_for(CASE)
    assert isinstance(s, settings_record(schema))
    assert (s.topk, s.wiring, s.extra) == (3, None, {})
    assert asdict(s) == {"topk": 3, "wiring": None, "extra": {}}
    # refusals are the schema's, word for word
    with pytest.raises(ConfigError, match=r"^--engines demo\[topk=0\]: topk: expected a value >= 1, got '0'$"):
        Demo(EngineSpec("demo", params=(("topk", "0"),))).settings_for(CASE)
    with pytest.raises(ConfigError, match=r"unknown parameter; did you mean 'topk'\?"):
        Demo(EngineSpec("demo", params=(("topkk", "2"),))).settings_for(CASE)
