"""`wiring: infer`: find which target hidden states a draft was trained on, from its behaviour.

The config's layer ids say what an engine will *read*, not what the draft *learned on*. A draft
fed the tensors it was trained on predicts the target's next token far better than one fed
anything else, so each candidate wiring is scored by the draft's step-0 top-1 agreement with
the target's greedy token over every prompt position. The evidence is one capture per prompt
holding the target's `target.h.{k}` (and `target.final_norm`, `target.logits`): the reference
capture holds all of them, so a candidate costs one draft forward (all prompts in one batch)
and no target forward.

Search (never the full (L+2)^A grid; `benchmarks/test_bench_infer_wiring.py` counts forwards):
  1. starts: the config's ids as each ecosystem reads them (difftest.rules.wiring presets) and the
     usual miswirings of that reading (embedding prepended, shifted by one); the starts not
     significantly worse than the best start are climbed from.
  2. coordinate ascent: each fc slot in turn tried at every available tensor (h0..hL, the final
     norm) with the others fixed; repeated until a whole sweep improves nothing.
  3. widening: where a slot's alternatives score within Z_WIDEN standard errors of the chosen
     one, the close alternatives of every pair of slots are tried jointly (a coupled move the
     single-slot sweep cannot make); any improvement restarts the ascent.

Decision. Every comparison is paired (the same positions, the same labels), so the statistic is
McNemar's: with b = positions only wiring A gets right and c = positions only B gets right,
z = (b - c) / sqrt(b + c) is the difference in agreement in units of its binomial standard
error under "A and B are equally good". The harness says *trained on X* only when
  * every slot's contrast is significant (z >= Z_DECIDE): moving that slot alone to its best
    alternative loses agreement beyond sampling spread, so each slot is pinned down. Top-1
    agreement is coarse: a slot the draft leans on lightly (the embedding, whose information the
    deeper slots carry too) may flip few argmaxes. Such a slot is pinned instead by the same
    forwards' per-position log-probability of the target's token, a paired z (mean difference over
    its standard error) >= Z_DECIDE; each slot reports which statistic pinned it. The runner-up
    and its margin are reported either way; and
  * the best agreement is significantly above the draft's agreement on the same tensors taken
    from *unrelated positions* (a fixed shuffle): the draft demonstrably uses its fc inputs.
    An untrained or random draft fails this: its agreement is chance, whatever it is fed.
Otherwise it says "cannot tell" and why. Z_DECIDE = 3 is a one-sided ~0.1% false-alarm rate per
comparison, small enough for the A + 1 comparisons a decision makes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from difftest.base.errors import ConfigError
from difftest.base.names import FINAL_NORM, TARGET_LOGITS, hidden_index, hidden_name
from difftest.records.wiring_inference import Z_DECIDE, Reading, SlotContrast, WiringInference
from difftest.rules.wiring import PRESETS, READING_PRESETS, short_name

Z_WIDEN = 2.0  # alternatives within this many standard errors of the chosen one are "close"
WIDEN_TOP = 3  # at most this many close alternatives per slot enter the pairwise search
MAX_CLIMBS = 3  # starts climbed from (the best and those not significantly worse)
MAX_SWEEPS = 10
SHUFFLE_SEED = 1234

WiringKey = tuple[str, ...]


@dataclass
class Scores:
    """Per position, under one wiring: top-1 hit, and the draft's log-probability of the target's token
    (0 where that token is outside the draft vocabulary: the same for every wiring)."""

    hits: torch.Tensor  # bool [N]
    logp: torch.Tensor  # float [N]

    @property
    def key(self) -> tuple[int, float]:
        """Ranking: agreement first; the log-probability only breaks exact ties."""
        return int(self.hits.sum()), float(self.logp.double().sum())


Scorer = Callable[[WiringKey], Scores]


def paired_z(a: torch.Tensor, b: torch.Tensor) -> float:
    """McNemar's z for 'a agrees more often than b' over the same positions (0 when they never differ)."""
    only_a = int((a & ~b).sum())
    only_b = int((~a & b).sum())
    return 0.0 if only_a + only_b == 0 else (only_a - only_b) / math.sqrt(only_a + only_b)


def paired_t(a: torch.Tensor, b: torch.Tensor) -> float:
    """Paired z of mean(a - b) (per-position log-probabilities of the same tokens); 0 when identical."""
    d = a.double() - b.double()
    if d.numel() < 2:
        return 0.0
    sd = float(d.std())
    return 0.0 if sd == 0 else float(d.mean()) / (sd / math.sqrt(d.numel()))


# ---------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------


class Search:
    """Memoised scores of wirings; `forwards` counts the distinct wirings scored (one draft forward each)."""

    def __init__(self, scorer: Scorer, candidates: Sequence[str], num_slots: int):
        if num_slots < 1 or not candidates:
            raise ConfigError("infer wiring: nothing to search (no fc slots or no target tensors)")
        self.scorer = scorer
        self.candidates = list(candidates)
        self.num_slots = num_slots
        self.memo: dict[WiringKey, Scores] = {}
        self.sweeps = 0
        self.widened = 0  # pairwise widenings tried

    @property
    def forwards(self) -> int:
        return len(self.memo)

    def scores(self, w: WiringKey) -> Scores:
        if w not in self.memo:
            self.memo[w] = self.scorer(w)
        return self.memo[w]

    def score(self, w: WiringKey) -> torch.Tensor:
        return self.scores(w).hits

    def count(self, w: WiringKey) -> tuple[int, float]:
        return self.scores(w).key

    def agreement(self, w: WiringKey) -> float:
        h = self.score(w)
        return float(h.float().mean()) if h.numel() else 0.0

    def variants(self, w: WiringKey, slot: int) -> list[WiringKey]:
        return [w[:slot] + (c,) + w[slot + 1 :] for c in self.candidates if c != w[slot]]

    def ascend(self, w: WiringKey) -> WiringKey:
        """Coordinate ascent: move one slot at a time to its best tensor until a sweep changes nothing."""
        for _ in range(MAX_SWEEPS):
            self.sweeps += 1
            moved = False
            for slot in range(self.num_slots):
                best = max(self.variants(w, slot), key=self.count, default=w)
                if self.count(best) > self.count(w):
                    w, moved = best, True
            if not moved:
                break
        return w

    def close(self, w: WiringKey, slot: int) -> list[str]:
        """Tensors for `slot` whose variant is not significantly worse than w (z < Z_WIDEN), best first."""
        base = self.score(w)
        near = [v for v in self.variants(w, slot) if paired_z(base, self.score(v)) < Z_WIDEN]
        near.sort(key=self.count, reverse=True)
        return [v[slot] for v in near[:WIDEN_TOP]]

    def widen(self, w: WiringKey) -> WiringKey | None:
        """Try the close alternatives of every pair of slots jointly; the first better wiring, or None."""
        close = [self.close(w, s) for s in range(self.num_slots)]
        for i, j in itertools.combinations(range(self.num_slots), 2):
            if not close[i] or not close[j]:
                continue
            self.widened += 1
            for a, b in itertools.product([w[i], *close[i]], [w[j], *close[j]]):
                slots = list(w)
                slots[i], slots[j] = a, b
                v = tuple(slots)
                if self.count(v) > self.count(w):
                    return v
        return None

    def run(self, starts: Sequence[WiringKey]) -> WiringKey:
        starts = list(dict.fromkeys(s for s in starts if len(s) == self.num_slots and set(s) <= set(self.candidates)))
        if not starts:
            starts = [tuple(self.candidates[:1] * self.num_slots)]
        ranked = sorted(starts, key=self.count, reverse=True)
        top = self.score(ranked[0])
        climb = [s for s in ranked if paired_z(top, self.score(s)) < Z_WIDEN][:MAX_CLIMBS]
        best = max((self.ascend(s) for s in climb), key=self.count)
        while True:
            wider = self.widen(best)
            if wider is None:
                return best
            best = self.ascend(wider)


# ---------------------------------------------------------------------------------------
# Evidence: what the target computed on the prompts
# ---------------------------------------------------------------------------------------


@dataclass
class Evidence:
    tokens: list[list[int]]  # per prompt: the token ids
    labels: list[torch.Tensor]  # per prompt [n]: the target's greedy next token after each position
    tensors: list[dict[str, torch.Tensor]]  # per prompt: canonical name -> [n, H]
    num_layers: int
    source: str  # where the target tensors came from, for the report
    label_source: str = "target greedy (argmax of target.logits)"

    @property
    def candidates(self) -> list[str]:
        """Target tensors every prompt holds, in data-flow order (h0..hL, then the final norm)."""
        common = set(self.tensors[0]).intersection(*self.tensors[1:]) if self.tensors else set()
        layers = {n: k for n in common if (k := hidden_index(n)) is not None}
        hs = sorted(layers, key=layers.__getitem__)
        return hs + ([FINAL_NORM] if FINAL_NORM in common else [])

    @property
    def positions(self) -> int:
        return sum(max(len(t) - 1, 0) for t in self.tokens)


def evidence_from_captures(captures: Sequence, source: str) -> Evidence:
    """From captures (difftest.records.capture.Capture) of any engine that holds `target.h.*`: the reference,
    a training dump (`train`), an engine that captures every layer. Labels are the target's greedy
    tokens where the capture has `target.logits`, else the sequence's own next tokens (a training
    dump's sequences are the target's responses) and the report says so."""
    if not captures:
        raise ConfigError(f"infer wiring: no captures from {source}")
    tokens, labels, tensors = [], [], []
    label_source = "target greedy (argmax of target.logits)"
    num_layers = 0
    for i, cap in enumerate(captures):
        ids = list(cap.meta.prompt_ids)
        t = {n: v.float() for n, v in cap.tensors.items() if hidden_index(n) is not None or n == FINAL_NORM}
        if not t or not ids:
            raise ConfigError(f"infer wiring: {source} capture of prompt {i} holds no target.h.* or no prompt ids")
        bad = [n for n, v in t.items() if v.dim() != 2 or v.shape[0] != len(ids)]
        if bad:
            raise ConfigError(
                f"infer wiring: {source} prompt {i}: {bad[0]} has shape {list(t[bad[0]].shape)}, expected [{len(ids)}, H]"
            )
        if TARGET_LOGITS in cap.tensors:
            lab = cap.tensors[TARGET_LOGITS].float().argmax(-1)
        else:
            label_source = "the sequences' next tokens (no target.logits in the capture)"
            lab = torch.tensor(ids[1:] + [-1])
        tokens.append(ids)
        labels.append(lab.long())
        tensors.append(t)
        num_layers = max(num_layers, int(cap.meta.num_layers or 0), *(hidden_index(n) or 0 for n in t))
    return Evidence(tokens, labels, tensors, num_layers, source, label_source)


class DraftScorer:
    """Step-0 agreement of a draft under a wiring, all prompts in one right-padded batch.

    Position j of a prompt sees the wiring's tensors at j and the embedding of token j+1 and
    predicts the target's greedy token after j+1 (as difftest_engines.ref.train.step0_agreement); right
    padding never reaches a real position under the causal mask, so one forward scores all.
    """

    def __init__(self, draft, evidence: Evidence):
        self.draft = draft.float().eval()
        self.evidence = evidence
        lengths = [len(t) - 1 for t in evidence.tokens]
        if min(lengths) < 1:
            raise ConfigError("infer wiring: every prompt needs at least 2 tokens")
        P, m = len(lengths), max(lengths)
        self.ids = torch.zeros(P, m, dtype=torch.long)
        self.labels = torch.full((P, m), -1, dtype=torch.long)
        self.valid = torch.zeros(P, m, dtype=torch.bool)
        for p, (toks, lab) in enumerate(zip(evidence.tokens, evidence.labels)):
            n = lengths[p]
            self.ids[p, :n] = torch.tensor(toks[1:])
            self.labels[p, :n] = lab[1 : n + 1]
            self.valid[p, :n] = lab[1 : n + 1] >= 0  # a sequence's last token has no next token to predict
        self.positions = torch.arange(m)[None, :].expand(P, m)
        # target id -> draft id (-1 outside the draft vocabulary), for the log-probability of the label
        d = self.draft
        to_draft = torch.full((d.cfg.vocab_size,), -1, dtype=torch.long)
        to_draft[torch.arange(d.cfg.draft_vocab_size) + d.d2t.long()] = torch.arange(d.cfg.draft_vocab_size)
        self.label_draft = torch.where(self.labels >= 0, to_draft[self.labels.clamp_min(0)], -1)
        self.features: dict[str, torch.Tensor] = {}
        for name in evidence.candidates:
            H = evidence.tensors[0][name].shape[-1]
            f = torch.zeros(P, m, H)
            for p, n in enumerate(lengths):
                f[p, :n] = evidence.tensors[p][name][:n]
            self.features[name] = f
        flat = self.valid.flatten().nonzero().squeeze(1)
        gen = torch.Generator().manual_seed(SHUFFLE_SEED)
        # a derangement-like shuffle of the real positions: features from unrelated positions
        self._shuffle_src = flat[torch.randperm(flat.numel(), generator=gen)]
        self._shuffle_dst = flat

    def fc_in(self, w: WiringKey) -> torch.Tensor:
        return torch.cat([self.features[n] for n in w], dim=-1)

    @torch.no_grad()
    def scores(self, w: WiringKey, fc_in: torch.Tensor | None = None) -> Scores:
        fc = self.fc_in(w) if fc_in is None else fc_in
        logits = self.draft(self.ids, self.draft.combine(fc), self.positions).logits.float()
        pred = self.draft.to_target_ids(logits.argmax(-1))
        inside = self.label_draft >= 0
        logp = torch.log_softmax(logits, -1).gather(-1, self.label_draft.clamp_min(0)[..., None])[..., 0]
        logp = torch.where(inside, logp, torch.zeros_like(logp))
        return Scores((pred == self.labels)[self.valid], logp[self.valid])

    def shuffled(self, w: WiringKey) -> Scores:
        fc = self.fc_in(w)
        flat = fc.reshape(-1, fc.shape[-1]).clone()
        flat[self._shuffle_dst] = fc.reshape(-1, fc.shape[-1])[self._shuffle_src]
        return self.scores(w, flat.reshape(fc.shape))

    def __call__(self, w: WiringKey) -> Scores:
        return self.scores(w)


# ---------------------------------------------------------------------------------------
# Starts and the config's readings
# ---------------------------------------------------------------------------------------


def config_readings(
    ids: list[int] | None, num_layers: int, num_slots: int, family: str = "llama"
) -> dict[str, WiringKey | None]:
    """engine -> the wiring that engine feeds for these config ids (None: it cannot serve them)."""
    engines = READING_PRESETS.get(family, READING_PRESETS["llama"])  # difftest.rules.wiring: rule data
    out: dict[str, WiringKey | None] = {}
    for engine, preset in engines.items():
        try:
            ks, _ = PRESETS[preset](list(ids) if ids else None, num_layers)
        except ConfigError:
            out[engine] = None
            continue
        w = tuple(hidden_name(k) for k in ks)
        out[engine] = w if len(w) == num_slots and all(0 <= k <= num_layers for k in ks) else None
    return out


def starts_for(ids: list[int] | None, num_layers: int, num_slots: int, family: str = "llama") -> list[WiringKey]:
    """The config's readings and the usual miswirings around them (the seed's: embedding in front)."""
    readings = [w for w in config_readings(ids, num_layers, num_slots, family).values() if w]
    ks = sorted(set(ids)) if ids else [2, num_layers // 2, num_layers - 3]
    extra = [
        [0, *ks][:num_slots],  # speculators-train with the embedding launched first (the seed)
        [k - 1 for k in ks],
        [k + 1 for k in ks],
        [0, *[k - 1 for k in ks]][:num_slots],
    ]
    for e in extra:
        if len(e) == num_slots and all(0 <= k <= num_layers for k in e):
            readings.append(tuple(hidden_name(k) for k in e))
    return list(dict.fromkeys(readings))


# ---------------------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------------------


def infer(
    scorer: Scorer,
    candidates: Sequence[str],
    num_slots: int,
    starts: Sequence[WiringKey],
    readings: dict[str, WiringKey | None] | None = None,
    shuffled: Callable[[WiringKey], Scores] | None = None,
    source: str = "",
    label_source: str = "",
) -> WiringInference:
    """Search and decide (see the module docstring). `shuffled(w)`: hits with w's tensors from
    unrelated positions; without it the uninformed baseline is not checked."""
    search = Search(scorer, candidates, num_slots)
    best = search.run(starts)
    hits = search.score(best)
    agreement = search.agreement(best)
    slots: list[SlotContrast] = []
    for slot in range(num_slots):
        alt = max(search.variants(best, slot), key=search.count, default=None)
        if alt is None:
            continue
        slots.append(
            SlotContrast(
                slot,
                best[slot],
                alt[slot],
                search.agreement(alt),
                agreement - search.agreement(alt),
                paired_z(hits, search.score(alt)),
                paired_t(search.scores(best).logp, search.scores(alt).logp),
            )
        )
    others = [w for w in search.memo if w != best]
    runner = max(others, key=search.count, default=None)
    reasons: list[str] = []
    if shuffled is not None:
        sh = shuffled(best).hits
        sh_agreement, sh_z = float(sh.float().mean()) if sh.numel() else 0.0, paired_z(hits, sh)
        if sh_z < Z_DECIDE:
            reasons.append(
                f"the draft agrees as often with its inputs taken from unrelated positions ({sh_agreement:.2f} "
                f"vs {agreement:.2f}, z {sh_z:.1f} < {Z_DECIDE:g}): it does not use its fc inputs "
                f"(untrained or random?)"
            )
    else:
        sh_agreement, sh_z = float("nan"), float("nan")
    for s in slots:
        if s.z < Z_DECIDE and s.z_logp < Z_DECIDE:
            reasons.append(
                f"slot {s.slot}: {short_name(s.chosen)} and {short_name(s.alternative)} are within sampling "
                f"spread (agreement {agreement:.3f} vs {s.alternative_agreement:.3f}, z {s.z:.1f}; "
                f"log-probability z {s.z_logp:.1f}; both < {Z_DECIDE:g})"
            )
    known = set(candidates)
    reads = [
        Reading(e, list(w) if w else None, search.agreement(w) if w and set(w) <= known else None)
        for e, w in (readings or {}).items()
    ]
    return WiringInference(
        decided=not reasons,
        wiring=list(best),
        agreement=agreement,
        runner_up=list(runner) if runner else None,
        runner_up_agreement=search.agreement(runner) if runner else None,
        margin=agreement - search.agreement(runner) if runner else None,
        margin_z=paired_z(hits, search.score(runner)) if runner else None,
        readings=reads,
        slots=slots,
        shuffled_agreement=sh_agreement,
        shuffled_z=sh_z,
        positions=int(hits.numel()),
        forwards=search.forwards,
        grid_size=len(candidates) ** num_slots,
        source=source,
        label_source=label_source,
        reasons=reasons,
    )


def infer_from_evidence(
    draft, draft_ids: list[int] | None, evidence: Evidence, family: str = "llama"
) -> WiringInference:
    """Infer the wiring of a loaded draft (difftest_engines.ref.eagle3) from the target tensors in `evidence`."""
    num_slots = int(draft.cfg.num_aux)
    candidates = evidence.candidates
    width = {evidence.tensors[0][n].shape[-1] for n in candidates}
    if width != {draft.cfg.target_hidden_size}:
        raise ConfigError(
            f"infer wiring: the evidence's target tensors are {sorted(width)} wide; the draft's fc takes "
            f"{draft.cfg.target_hidden_size}-wide chunks"
        )
    scorer = DraftScorer(draft, evidence)
    L = evidence.num_layers
    readings = config_readings(draft_ids, L, num_slots, family)
    starts = starts_for(draft_ids, L, num_slots, family)
    return infer(
        scorer, candidates, num_slots, starts, readings, scorer.shuffled, evidence.source, evidence.label_source
    )
