"""The core's public surface for engine packages (`difftest_engines/`, or any package that registers an
adapter, a check or a command through difftest's entry points): everything an engine may use of
the core, from one module. An engine imports `difftest.api`, never a floor of the core directly
(import-linter holds `difftest_engines` and `difftest_fixtures` to it), so the floors below can move without touching an engine.

Grouped by what an engine does with it: the adapter (engine interface, settings, errors), what it
returns (captures, canonical names, accept statistics), what it reads (the case, wiring, the rule
data, checkpoint files), and what an engine's checks and commands build on (the session, verdicts,
reports). Above the floors, beside the CLI and the plugin: it may name any of them."""

from difftest.base import definitions
from difftest.base.definitions import Definition, trainer_figures
from difftest.base.dtypes import CASE_DTYPES, MATMUL_PRECISIONS, DType, torch_dtype
from difftest.base.cli_args import deprecated_alias, id_list, non_empty, whole_number
from difftest.base.exit_codes import TROUBLE, USAGE
from difftest.base.errors import ConfigError, DifftestError, EngineError, EngineSpent, EngineUnavailable
from difftest.base.fc_wiring import Wiring
from difftest.base.check_registry import ENGINE, CheckSpec
from difftest.base.extensions import CHECK_GROUP, COMMAND_GROUP, Command, DraftLoader, registered
from difftest.base.content_digest import signature
from difftest.base.jsonfile import read_json
from difftest.base.names import (
    FC_IN,
    FINAL_NORM,
    TARGET_LOGITS,
    TARGET_PREFIX,
    draft_name,
    hidden_index,
    hidden_name,
)
from difftest.base.outputs import atomic_write, check_output_dir, check_output_file
from difftest.base.paths import ENV_BUILT_MARK, cache_root
from difftest.base.registry import registered_engines
from difftest.base.settings import Place, Schema, Setting, settings_record
from difftest.case import chat
from difftest.case.case import Case, Prompt, load_case
from difftest.case.prompt_sets import PromptFile, read_prompt_file
from difftest.checks import checks
from difftest.checks.lint import check_config_numbers, tied_draft_head_words, tied_head_findings, unused_tensor_words
from difftest.checks.verdict import Verdict
from difftest.compare import accept_judge
from difftest.compare.accept_judge import ACCEPT_SIGMAS
from difftest.compare.diagnose import match_fc_chunks
from difftest.compare.noise import STREAMED_FLOAT64
from difftest.records import CaptureMeta, CheckResult, ReplayRow
from difftest.records.acceptance import AcceptStats, accept_length_spread, normalise
from difftest.records.capture import Capture, cache_key
from difftest.records.check_data import CheckData, ServerAcceptData
from difftest.records.engine_info import EngineInfo
from difftest.records.tolerance import TolerancePair
from difftest.report import report_files, writer as report
from difftest.rules.checkpoint_integrity import refuse_on_errors, stored_tensors, target_findings
from difftest.rules.engine_releases import layer_rule
from difftest.rules.infer_wiring import evidence_from_captures, infer_from_evidence
from difftest.rules.layer_rules import declared_ids, rule_for, target_family
from difftest.rules.lint_checkpoint import d2t_convention_findings
from difftest.rules.overlay import overlay_checkpoint
from difftest.rules.weight_files import (
    LOAD_ERRORS,
    explain_load_failure,
    first_line,
    load_safetensors,
    torch_load_tensors,
)
from difftest.rules.wiring import resolve, short_name, trained_layer_ids
from difftest.run import infer_case
from difftest.run.engine import Engine, EngineSpec, parse_spec
from difftest.run.case_run import CaseRun, resolve_fixture
from difftest.run.pool import Options
from difftest.run.session import Session

__all__ = [
    # what a contributed command's parser and exit status build on (difftest.base.exit_codes)
    "deprecated_alias",
    "id_list",
    "non_empty",
    "whole_number",
    "USAGE",
    "TROUBLE",
    # the adapter: interface, specs, settings, errors, the registry
    "Engine",
    "EngineInfo",
    "EngineSpec",
    "parse_spec",
    "Schema",
    "Setting",
    "settings_record",
    "registered_engines",
    "ConfigError",
    "DifftestError",
    "EngineError",
    "EngineSpent",
    "EngineUnavailable",
    # what an adapter returns: captures under canonical names, accept-length statistics
    "Capture",
    "CaptureMeta",
    "ReplayRow",
    "cache_key",
    "FC_IN",
    "FINAL_NORM",
    "TARGET_LOGITS",
    "TARGET_PREFIX",
    "draft_name",
    "hidden_index",
    "hidden_name",
    "AcceptStats",
    "accept_length_spread",
    "normalise",
    # what it reads: the case, its chat prompts, the wiring and the engines' rules as data, files
    "Case",
    "Prompt",
    "load_case",
    "PromptFile",
    "Place",
    "read_prompt_file",
    "DType",
    "CASE_DTYPES",
    "torch_dtype",
    "MATMUL_PRECISIONS",
    "TolerancePair",
    "chat",
    "Wiring",
    "resolve",
    "trained_layer_ids",
    "short_name",
    "layer_rule",
    "rule_for",
    "declared_ids",
    "target_family",
    "infer_case",
    "evidence_from_captures",
    "infer_from_evidence",
    "overlay_checkpoint",
    "refuse_on_errors",
    "stored_tensors",
    "target_findings",
    "check_config_numbers",
    "unused_tensor_words",
    "tied_head_findings",
    "tied_draft_head_words",
    "d2t_convention_findings",
    "LOAD_ERRORS",
    "explain_load_failure",
    "first_line",
    "load_safetensors",
    "torch_load_tensors",
    "read_json",
    "signature",
    "cache_root",
    "resolve_fixture",
    "ENV_BUILT_MARK",
    "atomic_write",
    "check_output_dir",
    "check_output_file",
    # what an engine's checks and commands build on: contributions, the engine pool and a case's run, verdicts, reports
    "CHECK_GROUP",
    "COMMAND_GROUP",
    "Command",
    "DraftLoader",
    "CheckSpec",
    "ENGINE",
    "registered",
    "Options",
    "CaseRun",
    "Session",
    "Verdict",
    "CheckData",
    "CheckResult",
    "ServerAcceptData",
    "checks",
    "accept_judge",
    "ACCEPT_SIGMAS",
    "match_fc_chunks",
    "STREAMED_FLOAT64",
    "report",
    "report_files",
    "definitions",
    "Definition",
    "trainer_figures",
]
