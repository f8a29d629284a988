"""Nothing is accepted silently: every input a user can get wrong is refused with one line that
names the file, field or option, and a bad case fails only its own `load` item.

Cheap by construction: checkpoints here are a config.json (what validation reads) or a few
tensors; the plugin runs stop at start-up or run only `load` items, never a capture."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from difftest.case.case import Case, load_case
from difftest.base.registry import engine_schema
from difftest.run.engine import check_case_settings, check_settings, parse_engine_list, parse_spec
from difftest.base.errors import ConfigError
from difftest.run.case_run import CaseRun
from difftest.run.pool import EnginePool, Options
from difftest.base.settings import Schema, Setting, validate
from difftest.base.yamlfile import MAX_NODES
from helpers import one_line, run_pytest


@pytest.fixture
def checkpoints(tmp_path) -> tuple[Path, Path]:
    """A target and a draft as far as case validation reads them: their config.json."""
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir(), draft.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 512, "max_position_embeddings": 64}))
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    return target, draft


def write_case(directory: Path, checkpoints, extra: str = "", name: str = "c") -> Path:
    target, draft = checkpoints
    path = directory / f"{name}.yaml"
    path.write_text(f"target: {target}\ndraft: {draft}\nprompts:\n  - ids: [1, 2, 3]\n{extra}")
    return path


# -- engine settings: one schema per engine, validated by the core ------------------------------
@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("ref[wirng=sglang]", "--engines ref[wirng=sglang]: wirng: unknown parameter; did you mean 'wiring'?"),
        ("ref[foo=bar]", "--engines ref[foo=bar]: foo: unknown parameter"),
        ("ref[topk=0]", "topk: expected a value >= 1, got '0'"),
        ("ref[norm_output=maybe]", "norm_output: expected true or false"),
        ("ref[d2t=nope]", "d2t: expected one of identity"),
        ("train[format=specforg]", "did you mean 'specforge'?"),
        ("vllm[llm_args=x]", "llm_args: expected a mapping; set it in the case file"),
        ("sglang[mem_fraction_static=1.5]", "mem_fraction_static: expected a value <= 1"),
    ],
)
def test_bad_spec_parameter_is_refused_naming_the_spec(spec, fragment):
    parsed = parse_spec(spec)
    with pytest.raises(ConfigError) as e:
        check_settings(engine_schema(parsed.name), parsed)
    assert fragment in one_line(e)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("ref[wiring=vllm,wiring=sglang]", "parameter wiring given twice"),
        ("ref[=x]", "empty parameter name"),
        ("ref[wiring=]", "parameter wiring has an empty value"),
        ("ref[]", "empty parameter list"),
    ],
)
def test_malformed_spec_parameters_are_refused(spec, fragment):
    with pytest.raises(ConfigError) as e:
        parse_engine_list(spec)
    assert fragment in one_line(e)


def test_alias_and_name_of_one_setting_in_one_spec_are_refused():
    spec = parse_spec("sglang[topk=2,speculative_eagle_topk=3]")
    with pytest.raises(ConfigError, match="parameter speculative_eagle_topk given twice"):
        check_settings(engine_schema("sglang"), spec)


def test_spec_parameters_override_the_case_section_and_aliases_resolve(tmp_path, checkpoints):
    case = load_case(write_case(tmp_path, checkpoints, "engines: {sglang: {speculative_eagle_topk: 2, tp_size: 2}}\n"))
    s = check_settings(engine_schema("sglang"), parse_spec("sglang[topk=4]"), case)
    assert (s["speculative_eagle_topk"], s["tp_size"], s["max_total_tokens"]) == (4, 2, 4096)


@pytest.mark.parametrize(
    "section, fragment",
    [
        ("{ref: {wirng: sglang}}", "engines.ref.wirng: unknown setting; did you mean 'wiring'?"),
        ("{ref: {topk: true}}", "engines.ref.topk: expected an integer, got True"),
        ("{ref: {topk: '2'}}", "engines.ref.topk: expected an integer, got '2'"),
        ("{vllm: {enforce_eager: 'yes'}}", "engines.vllm.enforce_eager: expected true or false"),
        ("{ref: sglang}", "engines.ref: expected a mapping of settings, got 'sglang'"),
        ("{ref: [wiring]}", "engines.ref: expected a mapping of settings"),
        ("{reff: {}}", "engines.reff: unknown engine; did you mean 'ref'?"),
    ],
)
def test_bad_engines_section_is_refused_naming_file_and_field(tmp_path, checkpoints, section, fragment):
    path = write_case(tmp_path, checkpoints, f"engines: {section}\n")
    with pytest.raises(ConfigError) as e:
        check_case_settings(load_case(path))  # the shape is the case loader's; settings the engines' schemas
    message = one_line(e)
    assert message.startswith(f"{path}: ") and fragment in message


def test_section_that_is_not_a_mapping_is_refused_by_the_validator():
    schema = Schema("x", (Setting("a", "int", "doc"),))
    with pytest.raises(ConfigError, match=r"^f.yaml: engines.x: expected a mapping of settings, got str$"):
        validate(schema, "a=1", section_where="f.yaml: engines.x")


def test_every_adapter_declares_a_schema_and_no_default_accepts_unknown_keys():
    for name in ("ref", "vllm", "sglang", "train"):
        schema = engine_schema(name)
        assert isinstance(schema, Schema) and schema.settings, name
        with pytest.raises(ConfigError, match="unknown setting"):
            validate(schema, {"surely_not_a_setting": 1}, section_where="c.yaml: engines." + name)


# -- case YAML ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, fragment",
    [
        ('allow_missing: "draft.layer0.*"\n', "allow_missing: expected a list of tensor name patterns"),
        ("expect: {top1_agrement: 0.5}\n", "expect.top1_agrement: unknown field; did you mean 'top1_agreement'?"),
        ("expect: {accept_length: {atl: 0.1}}\n", "expect.accept_length.atl: unknown field; did you mean 'atol'?"),
        ("expect: {top1_agreement: 1.5}\n", "expect.top1_agreement: expected a fraction in [0, 1]"),
        ('tolerances: {"draft.*": {atol: .nan}}\n', "tolerances.draft.*.atol: expected a finite number >= 0, got nan"),
        ('tolerances: {"draft.*": {atol: -1e-3}}\n', "tolerances.draft.*.atol: expected a finite number >= 0"),
        ('tolerances: {"draft.*": {atol: .inf}}\n', "tolerances.draft.*.atol: expected a finite number >= 0, got inf"),
        ("expect: {accept_length: {atol: -0.1}}\n", "expect.accept_length.atol: expected a finite number >= 0"),
        ('tolerances: {"draft.*": 1e-3}\n', "tolerances.draft.*: expected {atol: X, rtol: Y}"),
        ("tolerances: [1]\n", "tolerances: expected a mapping"),
        ("expect: 0.9\n", "expect: expected a mapping"),
        ("speculative: {num_steps: true}\n", "speculative.num_steps: expected a positive integer, got True"),
        ("speculative: {num_step: 3}\n", "speculative.num_step: unknown field; did you mean 'num_steps'?"),
        ("promts: [x]\n", "promts: unknown field; did you mean 'prompts'?"),
        (f"name: {'x' * 300}\n", "name: expected at most 100 letters"),
        ("name: ../escape\n", "name: expected at most 100 letters"),
        ("layer_ids: [1, true]\n", "layer_ids: expected a non-empty list of non-negative integers"),
        ("description: [a]\n", "description: expected a string"),
    ],
)
def test_bad_case_field_is_refused_naming_file_and_field(tmp_path, checkpoints, extra, fragment):
    path = write_case(tmp_path, checkpoints, extra)
    with pytest.raises(ConfigError) as e:
        load_case(path)
    message = one_line(e)
    assert message.startswith(f"{path}: ") and fragment in message


def test_prompt_id_that_is_a_bool_is_refused(tmp_path, checkpoints):
    path = write_case(tmp_path, checkpoints)
    path.write_text(path.read_text().replace("[1, 2, 3]", "[1, true, 3]"))
    with pytest.raises(ConfigError, match=r"prompts\[0\].ids: expected a non-empty list of non-negative integers"):
        load_case(path)


def test_repeated_yaml_key_is_refused_naming_the_line(tmp_path, checkpoints):
    path = write_case(tmp_path, checkpoints, "wiring: vllm\nwiring: sglang\n")
    with pytest.raises(ConfigError) as e:
        load_case(path)
    assert one_line(e) == f"{path}: line 6: key 'wiring' appears twice in one mapping"


def test_yaml_alias_bomb_is_refused_before_it_expands(tmp_path, checkpoints):
    levels = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        levels.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(levels) + "\n")
    with pytest.raises(ConfigError) as e:
        load_case(path)
    assert one_line(e).startswith(f"{path}: refused: expands to ") and f"more than {MAX_NODES}" in str(e.value)


def test_recursive_yaml_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("a: &x [*x]\n")
    with pytest.raises(ConfigError, match="refers to a value that contains it"):
        load_case(path)


# -- tensor name patterns: a pattern that matches no tensor of the case would be ignored -----------------
@pytest.mark.parametrize(
    "extra, fragment",
    [
        (
            'tolerances: {"draft.logitz": {atol: 1e-3, rtol: 1e-3}}\n',
            "tolerances: pattern 'draft.logitz' matches no canonical tensor name; did you mean 'draft.logits'",
        ),
        (
            'allow_missing: ["draft.layr0.*"]\n',
            "allow_missing[0]: pattern 'draft.layr0.*' matches no canonical tensor name; did you mean 'draft.layer0.*'",
        ),
        (
            'allow_missing: ["draft.layer0.*", "targt.h.*"]\n',
            "allow_missing[1]: pattern 'targt.h.*' matches no canonical",
        ),
        ('tolerances: {"": {atol: 1e-3}}\n', "tolerances: empty pattern"),
        ('allow_missing: [""]\n', "allow_missing[0]: empty pattern"),
        ('allow_missing: ["draft.step1.fc_out"]\n', "pattern 'draft.step1.fc_out' matches no canonical tensor name"),
    ],
)
def test_tensor_pattern_that_matches_no_canonical_name_is_refused_naming_the_closest(
    tmp_path, checkpoints, extra, fragment
):
    path = write_case(tmp_path, checkpoints, extra)
    with pytest.raises(ConfigError) as e:
        load_case(path)
    message = one_line(e)
    assert message.startswith(f"{path}: ") and fragment in message


def test_pattern_for_a_draft_step_the_case_does_not_take_is_refused_naming_num_steps(tmp_path, checkpoints):
    path = write_case(
        tmp_path, checkpoints, 'speculative: {num_steps: 3}\ntolerances: {"draft.step3.*": {atol: 1e-3}}\n'
    )
    with pytest.raises(ConfigError) as e:
        load_case(path)
    assert one_line(e) == (
        f"{path}: tolerances: pattern 'draft.step3.*' matches no tensor of this case: with "
        "speculative.num_steps 3 it captures target.*, draft.*, draft.step1.* .. draft.step2.*"
    )


@pytest.mark.parametrize(
    "pattern",
    [
        "target.h.61",  # any layer index: the target's depth is not read at load time
        "target.h.?",
        "target.h.1*",
        "target.*",
        "*",
        "draft.*",
        "draft.layer0.*",
        "draft.logits*",
        "draft.fc_in.[0-2]",  # the fc chunk views
        "draft.step3.*",
        "draft.step*.logits",
        "draft.step[1-3].layer0.attn_out",
        "draft.hidden_prenorm",
    ],
)
def test_pattern_that_matches_a_name_the_case_can_capture_loads(tmp_path, checkpoints, pattern):
    case = load_case(
        write_case(
            tmp_path, checkpoints, f'tolerances: {{"{pattern}": {{atol: 1e-3}}}}\nallow_missing: ["{pattern}"]\n'
        )
    )
    assert list(case.tolerances) == [pattern] and case.allow_missing == [pattern]


@pytest.mark.parametrize(
    "pattern, matches",
    [
        ("target.h.01", False),  # names carry str(k): no leading zero
        ("draft.step0.logits", False),  # step 0 is draft.logits
        ("draft.step1.fc_in", False),  # fc runs at step 0 only
        ("aux.router.0.scores", False),  # reference-side facts, never compared
        ("draft.step1[0-9].*", False),  # draft.step10.. with 4 steps
        ("target.h.[!0-9]", False),
        ("draft.step?.embeds", True),
        ("draft.fc_in.1?", True),
    ],
)
def test_pattern_validity_is_decided_against_the_name_grammar_not_a_list(pattern, matches):
    from difftest.base.names import pattern_could_match

    assert pattern_could_match(pattern, num_steps=4) is matches


# -- prompts -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt, given",
    [
        ("{ids: [1, 2], messages: [{role: user, content: hi}]}", "messages"),
        ("{ids: [1, 2], chat_template_kwargs: {enable_thinking: false}}", "chat_template_kwargs"),
    ],
)
def test_prompt_with_both_ids_and_messages_is_refused_naming_the_prompt(tmp_path, checkpoints, prompt, given):
    path = write_case(tmp_path, checkpoints, f"speculative:\n  prompts: [{{ids: [1]}}, {prompt}]\n")
    with pytest.raises(ConfigError) as e:
        load_case(path)
    assert one_line(e).startswith(f"{path}: speculative.prompts[1]: both ids and {given} given; a prompt is either")


def test_prompt_with_both_ids_and_messages_in_prompts_is_refused(tmp_path, checkpoints):
    path = write_case(tmp_path, checkpoints)
    path.write_text(
        path.read_text().replace("- ids: [1, 2, 3]", "- {ids: [1, 2, 3], messages: [{role: user, content: hi}]}")
    )
    with pytest.raises(ConfigError) as e:
        load_case(path)
    assert one_line(e).startswith(f"{path}: prompts[0]: both ids and messages given")


# -- expect_failure's engine: checked against the registered engines, not the run's --------------------
def test_expect_failure_for_an_unknown_engine_is_refused_naming_the_closest(tmp_path, checkpoints):
    path = write_case(tmp_path, checkpoints, "expect_failure: [{engine: reff, check: fc_inputs, cause: x}]\n")
    with pytest.raises(ConfigError) as e:
        load_case(path)
    message = one_line(e)
    assert message.startswith(f"{path}: expect_failure[0].engine: unknown engine 'reff' (did you mean 'ref'?)")


def test_expect_failure_for_a_registered_engine_outside_the_run_loads(tmp_path, checkpoints):
    # `vllm@0.24.0` applies to `--engines=ref,vllm@0.24.0`, not to a run of ref alone: still declared
    path = write_case(
        tmp_path, checkpoints, "expect_failure: [{engine: vllm@0.24.0, reference: ref, check: fc_inputs, cause: x}]\n"
    )
    (e,) = load_case(path).expect_failure
    assert (e.engine, e.reference) == ("vllm@0.24.0", "ref")


def test_non_utf8_case_file_is_one_line(tmp_path):
    path = tmp_path / "latin.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError) as e:
        load_case(path)
    assert one_line(e) == f"{path}: not UTF-8 text (byte 9)"


def _run(case: Case) -> CaseRun:
    ref = parse_spec("ref")
    return CaseRun(EnginePool(Options(engines=[ref], reference=ref)), case)


def test_prompt_longer_than_max_position_embeddings_is_refused(tmp_path, checkpoints):
    case = load_case(write_case(tmp_path, checkpoints, "speculative: {num_steps: 4, max_new_tokens: 8}\n"))
    case.prompts[0].ids = list(range(1, 61))  # 60 + 4 draft steps fit 64; speculating 8 more does not
    run = _run(case)
    assert len(run.prompt_ids()[0]) == 60
    with pytest.raises(ConfigError) as e:
        run.prompt_ids(speculative=True)
    assert one_line(e) == (
        f"{case.path}: prompts[0]: 60 tokens + 12 generated exceed the target's max_position_embeddings (64)"
    )


def test_out_of_vocabulary_prompt_id_is_refused(tmp_path, checkpoints):
    path = write_case(tmp_path, checkpoints)
    path.write_text(path.read_text().replace("[1, 2, 3]", "[1, 512, 3]"))
    with pytest.raises(ConfigError) as e:
        _run(load_case(path)).prompt_ids()
    assert one_line(e) == f"{path}: prompts[0]: token id 512 is outside the target's vocabulary (vocab_size 512)"


# -- checkpoints ----------------------------------------------------------------------------------
def test_integer_fc_weight_is_refused_naming_file_and_tensor(tmp_path):
    from difftest_engines.ref.eagle3 import load_state_dict

    save_file(
        {"fc.weight": torch.ones(4, 12, dtype=torch.int32), "d2t": torch.zeros(4, dtype=torch.long)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ConfigError) as e:
        load_state_dict(tmp_path)
    assert one_line(e) == (
        f"{tmp_path / 'model.safetensors'}: tensor fc.weight has dtype int32; draft weights must be floating point"
    )


def test_truncated_safetensors_is_one_line_naming_the_file(tmp_path):
    from difftest_engines.ref.eagle3 import load_state_dict

    save_file({"fc.weight": torch.ones(4, 12)}, str(tmp_path / "model.safetensors"))
    blob = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ConfigError) as e:
        load_state_dict(tmp_path)
    # the header read tells how much is missing (difftest.rules.checkpoint_integrity, through difftest.rules.weight_files)
    assert one_line(e).startswith(f"{tmp_path / 'model.safetensors'}: truncated: its header describes ")


def test_pickle_refusal_names_the_file_and_never_suggests_the_unsafe_load(tmp_path):
    from difftest_engines.ref.eagle3 import load_state_dict

    torch.save({"fc.weight": torch.ones(2, 2), "extra": Path("x")}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ConfigError) as e:
        load_state_dict(tmp_path)
    message = one_line(e)
    assert message.startswith(f"{tmp_path / 'pytorch_model.bin'}: refused") and "weights_only=False" not in message


@pytest.mark.parametrize(
    "config, fragment",
    [
        ([1, 2], "expected a JSON object, got list"),
        ({"hidden_size": "big", "vocab_size": 8}, "hidden_size: expected a positive integer, got 'big'"),
        ({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 8}, "this is an EAGLE-3 draft's config"),
        ({"speculators_model_type": "eagle3"}, "this is an EAGLE-3 draft's config"),
    ],
)
def test_bad_target_config_is_one_line_naming_the_file(tmp_path, config, fragment):
    from difftest_engines.ref.target import target_config

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        target_config(tmp_path)
    message = one_line(e)
    assert message.startswith(f"{tmp_path / 'config.json'}: ") and fragment in message


@pytest.mark.parametrize(
    "config, fragment",
    [
        ([1], "expected a JSON object, got list"),
        (
            {"hidden_size": "big", "num_attention_heads": 4, "vocab_size": 8, "intermediate_size": 8},
            "hidden_size: expected an integer, got 'big' (a string)",
        ),
    ],
)
def test_bad_draft_config_is_one_line_naming_the_file(tmp_path, config, fragment):
    from difftest_engines.ref.draft_loading import load_draft

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        load_draft(tmp_path)
    message = one_line(e)
    assert message.startswith(f"{tmp_path / 'config.json'}: ") and fragment in message


# -- the plugin: start-up options, and one failing item per bad case --------------------------------
def _project(tmp_path: Path, checkpoints, cases: dict[str, str]) -> Path:
    for rel, extra in cases.items():
        (tmp_path / Path(rel).parent).mkdir(parents=True, exist_ok=True)
        write_case(tmp_path / Path(rel).parent, checkpoints, extra, Path(rel).stem)
    return tmp_path


def test_bad_cases_fail_their_own_load_item_and_the_others_still_collect(tmp_path, checkpoints):
    root = _project(
        tmp_path,
        checkpoints,
        {
            "cases/good.yaml": "name: shared\n",
            "other/cases/twin.yaml": "name: shared\n",
            "cases/typo.yaml": "engines: {ref: {wirng: sglang}}\n",
            "cases/chars.yaml": 'allow_missing: "draft.layer0.*"\n',
        },
    )
    run = run_pytest(root, "cases/", "other/cases/", "--engines=ref", "-k", "load")
    assert run.returncode == 6, run.output  # a configuration error, not a regression
    assert "Traceback" not in run.output
    assert "3 failed" in run.output and "deselected" in run.output  # the good case's items were collected
    assert (
        f"{root / 'other/cases/twin.yaml'}: name: 'shared' is already the name of {root / 'cases/good.yaml'}"
        in run.output
    )
    assert "engines.ref.wirng: unknown setting; did you mean 'wiring'?" in run.output
    assert "allow_missing: expected a list of tensor name patterns" in run.output


@pytest.mark.parametrize(
    "option, fragment",
    [
        (
            "--engines=ref,ref[wirng=sglang]",
            "--engines ref[wirng=sglang]: wirng: unknown parameter; did you mean 'wiring'?",
        ),
        ("--engine-python=ref=/nonexistent", "--engine-python ref=/nonexistent: /nonexistent does not exist"),
        ("--engine-timeout=-1", "--engine-timeout: expected a positive number of seconds, got -1"),
        ("--out={file}", "--out: {file} is not a directory"),
    ],
)
def test_bad_start_up_option_is_a_one_line_usage_error(tmp_path, checkpoints, option, fragment):
    root = _project(tmp_path, checkpoints, {"cases/c.yaml": ""})
    (tmp_path / "afile").write_text("")
    fill = {"file": tmp_path / "afile"}
    run = run_pytest(root, "cases/", "--engines=ref", option.format(**fill))
    assert run.returncode == 4, run.output  # a usage error: nothing ran, nothing skipped
    assert fragment.format(**fill) in run.output
    assert "Traceback" not in run.output


@pytest.mark.parametrize(
    "item, fragment",
    [
        ("ref=/nonexistent", "--engine-python ref=/nonexistent: /nonexistent does not exist"),
        ("ref=/tmp", "--engine-python ref=/tmp: /tmp is a directory, not an interpreter"),
        ("ref={noexec}", "--engine-python ref={noexec}: {noexec} is not an executable file"),
        ("nope=/bin/false", "--engine-python nope=/bin/false: nope: unknown engine"),
        ("reff=/bin/false", "reff: unknown engine; did you mean 'ref'?"),
        ("ref[wiring=x]=/bin/false", "is not an engine name (NAME or NAME@LABEL)"),
        ("ref", "--engine-python: 'ref' is not NAME=PATH"),
    ],
)
def test_bad_engine_python_is_refused(tmp_path, item, fragment):
    from difftest.plugin import _engine_python

    noexec = tmp_path / "python"
    noexec.write_text("")
    noexec.chmod(stat.S_IRUSR | stat.S_IWUSR)
    with pytest.raises(ConfigError) as e:
        _engine_python(item.format(noexec=noexec))
    assert fragment.format(noexec=noexec) in one_line(e)


def test_engine_python_accepts_an_interpreter_or_an_environment(tmp_path):
    from difftest.plugin import _engine_python

    (tmp_path / "env" / "bin").mkdir(parents=True)
    (tmp_path / "env" / "bin" / "python").symlink_to(sys.executable)
    assert _engine_python(f"ref@old={tmp_path / 'env'}") == {"ref@old": str(tmp_path / "env" / "bin" / "python")}
    assert _engine_python(f"ref={sys.executable}") == {"ref": sys.executable}


def test_report_dir_under_a_file_is_refused_at_start_up(tmp_path):
    from difftest.plugin import _check_writable_dir

    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError) as e:
        _check_writable_dir(tmp_path / "afile" / "sub", "--report-dir")
    assert (
        one_line(e)
        == f"--report-dir: {tmp_path / 'afile'} is not a directory (needed for {tmp_path / 'afile' / 'sub'})"
    )
    _check_writable_dir(tmp_path / "new" / "dir", "--report-dir")  # creatable: fine, and nothing is created yet
    assert not (tmp_path / "new").exists()


def test_non_utf8_project_file_is_a_one_line_usage_error(tmp_path, checkpoints):
    root = _project(tmp_path, checkpoints, {"cases/c.yaml": ""})
    (root / "difftest.toml").write_bytes(b'[engines]\n"ref" = "caf\xe9"\n')
    run = run_pytest(root, "cases/", "--engines=ref")
    assert run.returncode == 4
    assert f"{root / 'difftest.toml'}: not UTF-8 text" in run.output and "Traceback" not in run.output


# -- reports --------------------------------------------------------------------------------------
REPORT = {
    "schema": "difftest.report",
    "schema_version": 2,
    "case": "c",
    "case_file": "c.yaml",
    "created": "now",
    "reference": "ref",
    "accept_length_definition": "d",
    "engines": {},
    "checks": [],
}


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"schema": "difftest.report", "schema_version": 2}, "case: field missing"),
        ({**REPORT, "engines": []}, "engines: expected an object, got a list"),
        ({**REPORT, "checks": [{"schema_version": 2, "x": 1}]}, "checks[0].x: unknown field"),
        ({"schema": "difftest.report/1", "case": "c"}, "schema_version: report schema version 1"),
    ],
)
@pytest.mark.parametrize("command", ["report", "bundle"])
def test_report_json_with_fields_missing_is_one_line(tmp_path, capsys, command, data, fragment):
    from difftest.cli import main

    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"difftest {command}: {path}: ") and fragment in err


def test_dollar_signs_in_plot_labels_stay_text():
    from difftest.report import html_report

    plt = html_report._plt()
    fig, ax = plt.subplots()
    ax.plot([1, 2], label="ref[attention_backend=$x]")
    ax.set_title("unbalanced $\\frac{")
    ax.legend()
    assert html_report._png(fig)  # mathtext would raise ValueError at savefig


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda m: m.pop("cases"), "cases: field missing"),
        (lambda m: m["cases"]["c"].pop("fingerprint"), "cases.c.fingerprint: field missing"),
        (lambda m: m["cases"]["c"]["engines"]["ref"].pop("captures"), "cases.c.engines.ref.captures: field missing"),
        (lambda m: m["cases"]["c"]["engines"].update(ref=[]), "cases.c.engines.ref: expected an object, got a list"),
        (
            lambda m: m["cases"]["c"]["engines"]["ref"]["accept"].pop("num_verify"),
            "cases.c.engines.ref.accept.num_verify: field missing",
        ),
        (
            lambda m: m["cases"]["c"]["engines"]["ref"].update(fiel="c.safetensors"),
            "cases.c.engines.ref.fiel: unknown field (did you mean 'file'?)",
        ),
        (
            lambda m: m["cases"]["c"]["engines"]["ref"]["captures"].append(
                {"tensors": [], "meta": {"num_layers": "6"}}
            ),
            "cases.c.engines.ref.captures[0].meta.num_layers: expected an integer or null, got a string",
        ),
    ],
)
def test_baseline_manifest_missing_a_field_is_one_line_at_start_up(tmp_path, mutate, fragment):
    from difftest.records.baseline_manifest import BaselineManifest

    from difftest.run.baseline import SCHEMA, BaselineSource

    accept = {"num_verify": 1, "num_accepted": 0, "num_draft_steps": 3, "accept_length": 1.0}
    manifest = {
        "schema": SCHEMA,
        "created": "now",
        "git_sha": None,
        "harness": {},
        "cases": {
            "c": {
                "fingerprint": "f",
                "engines": {"ref": {"info": {}, "file": "c.safetensors", "accept": accept, "captures": []}},
            }
        },
    }
    BaselineManifest.from_dict(json.loads(json.dumps(manifest)), "manifest.json")  # unmutated, it reads
    mutate(manifest)
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as e:
        BaselineSource(tmp_path, "v1")
    assert one_line(e) == f"{tmp_path / 'v1' / 'manifest.json'}: {fragment}"


def test_duplicate_case_name_keeps_save_baseline_from_writing(tmp_path, checkpoints):
    root = _project(
        tmp_path, checkpoints, {"cases/good.yaml": "name: shared\n", "more/cases/twin.yaml": "name: shared\n"}
    )
    run = run_pytest(root, "cases/", "more/cases/", "--engines=ref", "--save-baseline=v1", "-k", "load")
    assert run.returncode == 6  # a configuration error
    assert (
        f"baseline 'v1' NOT written: {root / 'more/cases/twin.yaml'}: name: 'shared' is already the name of "
        f"{root / 'cases/good.yaml'}"
    ) in run.output
    assert not (root / "baselines" / "v1").exists()


def test_engine_log_file_name_is_safe_for_any_spec():
    from difftest.base.paths import log_file_name

    assert log_file_name("ref[wiring=vllm]") == "ref[wiring=vllm].log"
    long = log_file_name("ref[wiring=" + "h0+" * 150 + "h1,x=$a/b$]")
    assert "/" not in long and "$" not in long and len(long.encode()) <= 130


# -- a file section read through a Schema ----------------------------------------------------------
def test_a_schema_of_a_dataclass_reads_a_section_into_that_record():
    from dataclasses import dataclass

    from difftest.base.settings import Place, read

    @dataclass(frozen=True)
    class Limits:
        steps: int
        label: str

    schema = Schema.of(
        Limits,
        "limits",
        (Setting("label", "str", "a name", default="x"), Setting("steps", "int", "how many", default=2, min=1)),
        what="field",
    )
    assert [s.name for s in schema.settings] == ["steps", "label"]  # the record's order
    assert read(schema, {"steps": 3}, Place("f.yaml", "limits")) == Limits(3, "x")
    assert read(schema, None, Place("f.yaml", "limits")) == Limits(2, "x")
    with pytest.raises(ConfigError, match=r"^f.yaml: limits.stepz: unknown field; did you mean 'steps'\?"):
        read(schema, {"stepz": 3}, Place("f.yaml", "limits"))
    with pytest.raises(ConfigError, match=r"^f.yaml: limits.steps: expected a value >= 1, got 0$"):
        read(schema, {"steps": 0}, Place("f.yaml", "limits"))
    with pytest.raises(ValueError, match="not its fields"):
        Schema.of(Limits, "limits", (Setting("steps", "int", "how many"),))
