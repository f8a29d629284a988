"""The live-server check: a running server's acceptance against the reference's prediction on the
server's own tokens. The `server` engine contributes it (the `difftest.checks` entry point
`server_accept_length`, difftest.api.CheckSpec) as the `accept_length` item of its engines.

  1. the server's effective settings (`server` engine info, difftest_engines.server.client), with flags
     where they differ from what was asked for or what the case describes;
  2. the case's speculative prompts sent one at a time, greedy (the `server` engine's speculate);
  3. the reference replays each request's prompt + output through its draft with the server's
     effective num_steps / topk / num_draft_tokens (Engine.replay, difftest_engines/ref/replay.py);
  4. accept length and per-position acceptance against that prediction, with the expected spread
     (difftest.records.acceptance.accept_length_spread), per request and over all of them: a verdict.

Which numbers are exact: SGLang's are the server's own per-request counters. vLLM's are /metrics
deltas around each request: a request another client ran at the same time is in them too; such a
request is marked (difftest_engines.server.client) and left out of the verdict when clean ones remain.
"""

from __future__ import annotations

from difftest.api import accept_judge
from difftest.api import ACCEPT_SIGMAS
from difftest.api import AcceptStats, accept_length_spread
from difftest.api import Case
from difftest.api import CaseRun
from difftest.api import EngineSpec
from difftest.api import ConfigError
from difftest.api import ENGINE, CheckSpec
from difftest.api import ServerAcceptData
from difftest.api import Verdict
from difftest.api import TolerancePair


def flags(settings: dict, case: Case) -> list[str]:
    """What a user should know about the server's effective settings, one line each."""
    out = []
    kind = settings["kind"]
    steps, topk, ndt = settings.get("num_steps"), settings.get("topk"), settings.get("num_draft_tokens")
    launch = settings.get("launch") or {}
    wanted = case.engine_settings(kind)
    algo = str(settings.get("algorithm") or "")
    if algo and "EAGLE3" not in algo.upper().replace("-", "").replace("_", "") and not algo.startswith("speculative"):
        out.append(f"speculative algorithm {algo}, not EAGLE-3: the reference predicts an EAGLE-3 draft")
    if kind == "sglang" and topk == 1 and steps is not None:
        asked = launch.get("speculative_num_draft_tokens", wanted.get("speculative_num_draft_tokens"))
        if asked is not None and str(asked) != str(ndt):
            out.append(f"topk 1 forces num_draft_tokens = {ndt} (num_steps + 1); {asked} configured")
        else:
            out.append(f"topk 1: a chain; num_draft_tokens = {ndt} (num_steps + 1) whatever is configured")
    if kind == "sglang":
        for key, ours in (("speculative_num_steps", "num_steps"), ("speculative_eagle_topk", "topk")):
            if key in launch and settings.get(ours) is not None and str(settings[ours]) != str(launch[key]):
                out.append(f"SGLang resolved {key} = {settings[ours]}; {launch[key]} was asked for")
    case_steps = wanted.get("speculative_num_steps") or wanted.get("num_speculative_tokens") or case.num_steps
    if steps is not None and int(case_steps) != int(steps):
        out.append(
            f"the server drafts {steps} tokens per step; the case says {case_steps}: the prediction uses the server's {steps}"
        )
    tp_key = "tp_size" if kind == "sglang" else "tensor_parallel_size"  # the case's name for it (engines/*/settings.py)
    if wanted.get(tp_key) is not None and settings.get("tp") is not None and int(wanted[tp_key]) != int(settings["tp"]):
        out.append(
            f"the server runs tensor parallelism {settings['tp']}; the case's engines.{kind}.{tp_key} says "
            f"{wanted[tp_key]} (the prediction replays the server's tokens: it does not depend on it)"
        )
    if kind == "vllm" and not settings.get("draft_model"):
        out.append(
            "draft path not published (vLLM serves /server_info only with VLLM_SERVER_DEV_MODE=1): "
            "num_speculative_tokens read from the /metrics per-position counters"
        )
    return out


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"


def check(run: CaseRun, spec: EngineSpec, tol: TolerancePair | None) -> tuple[bool, str, ServerAcceptData]:
    """(passed, message, data) of a server's accept length against the reference's replay."""
    case, reference = run.case, run.options.reference
    settings = run.pool.client(spec).started_info.settings
    stats = run.speculate(spec)
    steps = settings.get("num_steps") or case.num_steps
    topk = settings.get("topk") or 1
    ndt = settings.get("num_draft_tokens") or steps + 1
    if topk < 1 or ndt < 2:
        raise ConfigError(f"{spec.id}: the server reports topk {topk}, num_draft_tokens {ndt}: cannot predict that")
    requests = stats.per_request
    replays = run.replay(reference, [(r["prompt"], r["output"]) for r in requests], steps, topk, ndt)
    clean = [i for i, r in enumerate(requests) if not r.get("contaminated")]
    judged = clean or list(range(len(requests)))
    server_total = AcceptStats(0, 0, steps, [0] * steps, 0, stats.source)
    ref_total = AcceptStats(0, 0, steps, [0] * steps, 0, "")
    lines, per_request = [], []
    for i, (r, rep) in enumerate(zip(requests, replays)):
        s = AcceptStats(r["num_verify"], r["num_accepted"], steps, list(r["accepted_per_pos"]), 1)
        p = rep.stats
        if i in judged:
            server_total, ref_total = server_total.merge(s), ref_total.merge(p)
        ref_total.source = p.source
        spread = (accept_length_spread(s) ** 2 + accept_length_spread(p) ** 2) ** 0.5
        kind = "exact" if r["exact"] else "delta"
        note = (
            f"; NOT JUDGED: {r['contaminated']}"
            if r.get("contaminated") and clean
            else (f"; {r['contaminated']}" if r.get("contaminated") else "")
        )
        mism = (
            f"; the reference target picks another token at {rep.target_mismatches} output positions (first: {rep.first_mismatch})"
            if rep.target_mismatches
            else ""
        )
        lines.append(
            f"  request {i}: AL {s.accept_length:.3f} ({kind}, {s.num_verify} verifies) vs predicted "
            f"{p.accept_length:.3f} +- {ACCEPT_SIGMAS * spread:.3f}; per position {_fmt(s.acceptance_rate_per_pos)} vs "
            f"{_fmt(p.acceptance_rate_per_pos)}{mism}{note}"
        )
        per_request.append(
            {
                "server": r,
                "predicted": rep.stats.to_dict(),
                "target_mismatches": rep.target_mismatches,
                "first_mismatch": rep.first_mismatch,
                "judged": i in judged,
                "numbers": kind,
            }
        )
    a, b = ref_total.accept_length, server_total.accept_length
    # the same tokens on both sides: no numerical move to add; sampling spread over the verifies only
    gate = accept_judge.judge(ref_total, server_total, None, tol, "on the server's own tokens")
    passed, allowed, spread = gate.ok, gate.allowed_accept, gate.spread
    exact = all(r["exact"] for r in requests)
    declared = "" if gate.tolerance is None else f", declared tolerance {gate.tolerance:.3f}"
    head = ("accept length collapsed: " if gate.collapsed else "") + (
        f"server accept length {b:.3f} vs the reference's prediction {a:.3f} on the same tokens: "
        f"{(b - a) / a * 100 if a else float('nan'):+.1f}%, allowed |diff| <= {allowed:.3f} ({ACCEPT_SIGMAS:g} x expected "
        f"spread {spread:.3f} over {server_total.num_verify} verify steps{declared}); per-position acceptance "
        f"{_fmt(server_total.acceptance_rate_per_pos)} vs {_fmt(ref_total.acceptance_rate_per_pos)}: {gate.summary()}"
    )
    verdict = (
        "PASS: the deployment accepts what the reference predicts"
        if passed
        else (
            "FAIL: the deployment accepts less than the reference predicts (draft miswired, wrong draft or settings)"
            if b < a
            else "FAIL: the deployment accepts more than the reference predicts (the reference's wiring or draft is not the server's)"
        )
    )
    numbers = (
        "exact: SGLang's per-request meta_info counters"
        if exact
        else "deltas: vLLM /metrics counters around each request (sent one at a time); a concurrent request "
        "on the server would be in them and is flagged"
    )
    shown = {
        k: settings.get(k)
        for k in ("kind", "url", "model", "draft_model", "algorithm", "num_steps", "topk", "num_draft_tokens", "tp")
    }
    flag_lines = flags(settings, case)
    mismatched = sum(r.target_mismatches for r in replays)
    msg = [
        head,
        verdict,
        "server: " + ", ".join(f"{k} {v}" for k, v in shown.items() if v is not None),
        *(f"flag: {f}" for f in flag_lines),
        f"numbers: {numbers}; prediction: {ref_total.source} by {reference.id}",
    ]
    if mismatched:
        msg.append(
            f"note: the reference target's greedy token differs from the server's at {mismatched} output positions "
            "(another model, lower precision or near ties): the replay still follows the server's tokens"
        )
    msg += lines
    data = ServerAcceptData(
        reference=ref_total,
        engine=server_total,
        allowed=allowed,
        spread=spread,
        gate=gate,
        server_settings=settings,
        flags=flag_lines,
        per_request=per_request,
        numbers="exact" if exact else "deltas",
        verdict=verdict,
    )
    return passed, "\n".join(msg), data


def check_server_acceptance(run: CaseRun, spec: EngineSpec) -> Verdict:
    """The `accept_length` item of a running server; a tolerance the case declares only widens it."""
    return Verdict(*check(run, spec, run.case.expect.accept_length))


CHECK = CheckSpec(
    "server_accept_length",
    check_server_acceptance,
    ENGINE,
    "a running server's acceptance against the reference's replay of its own tokens",
    engines=("server",),
    data=ServerAcceptData,
    replaces="accept_length",
)
