"""Which target layer is each tensor of a training-data dump? The files do not say.

Two ways to find out:
  * against a reference target (`identify_against_target`): run the target on the sample's
    tokens and match each dumped tensor to the `target.h.{k}` / `target.final_norm` it equals
    (smallest relative error; cosine reported too: pre- and post-norm final layers have
    cosine ~1 with each other, the error tells them apart);
  * without one (`identify_by_statistics`): the norm profile (residual norms grow with
    depth: the embedding is the smallest, order by norm shows a permuted dump), the
    embedding exactly (a tensor equal to embed(token) row by row, when embedding weights
    are at hand), and the verifier tensor by `lm_head(norm(x))` top-1 against the data's own
    next tokens (the final layer reproduces model-generated text; a shallower layer does not).

The result reads like the seed's diagnosis:
    dumped tensors = [h0, h3, h31, h59]; trainer fed fc [h0, h3, h31]; verifier = h59 (not the final layer)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from difftest_engines.trainingdata.train_accuracy import rms_norm
from difftest.api import FINAL_NORM, hidden_index
from difftest.api import short_name

MATCH_REL_ERR = 0.05  # a dumped tensor "is" a reference tensor when their relative error is below this
FINAL_TOP1 = 0.9  # top-1 agreement with the data's next tokens expected of the final layer on model-generated text


@dataclass
class TensorIdentity:
    position: int  # index in the dump's list
    name: str | None  # canonical name, None when nothing matches
    rel_err: float = float("nan")
    cosine: float = float("nan")
    runner_up: str | None = None
    norm: float = 0.0  # mean L2 norm of a row
    top1_next: float | None = None  # lm_head(norm(x)) top-1 vs the data's next tokens
    note: str = ""

    def short(self) -> str:
        return short_name(self.name) if self.name else "?"


@dataclass
class Identification:
    tensors: list[TensorIdentity]
    fc_count: int
    method: str  # "target" | "statistics"
    num_layers: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fc_names(self) -> list[str | None]:
        return [t.name for t in self.tensors[: self.fc_count]]

    @property
    def verifier(self) -> TensorIdentity:
        return self.tensors[self.fc_count]

    def verifier_is_final(self) -> bool | None:
        v = self.verifier
        if v.name is not None and self.num_layers is not None:
            return v.name == FINAL_NORM or hidden_index(v.name) == self.num_layers
        if v.top1_next is not None:
            return v.top1_next >= FINAL_TOP1
        return None

    def summary(self) -> str:
        names = [t.short() for t in self.tensors]
        v = self.verifier
        final = self.verifier_is_final()
        if v.name == FINAL_NORM:
            tag = " (the final layer, after the norm)"
        elif final is True:
            tag = " (the final layer)"
        elif final is False:
            tag = (
                " (not the final layer"
                + (f"; the target has {self.num_layers} layers" if self.num_layers else "")
                + ")"
            )
        else:
            tag = ""
        text = (
            f"dumped tensors = [{', '.join(names)}]; trainer fed fc [{', '.join(names[: self.fc_count])}]; "
            f"verifier = {v.short()}{tag}"
        )
        if self.method == "statistics":
            text += "; norms [" + ", ".join(f"{t.norm:.3g}" for t in self.tensors) + "]"
            if v.top1_next is not None:
                text += f"; verifier top-1 vs next tokens {v.top1_next:.2f}"
        return text

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "summary": self.summary(),
            "names": [t.name for t in self.tensors],
            "fc_count": self.fc_count,
            "verifier_is_final": self.verifier_is_final(),
            "tensors": [t.__dict__ for t in self.tensors],
            "notes": self.notes,
        }


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    d = float(b.norm())
    return float((a - b).norm()) / d if d > 0 else float("inf")


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    d = float(a.norm() * b.norm())
    return float(a @ b) / d if d else 0.0


def _row_norm(x: torch.Tensor) -> float:
    return float(x.double().norm(dim=-1).mean())


def identify_against_target(
    dumped: list[torch.Tensor],  # each [n, H]: one sample's tensors (first n positions)
    reference: dict[str, torch.Tensor],  # canonical name -> [n, H] from the target on the same tokens
    fc_count: int,
    num_layers: int,
) -> Identification:
    out = []
    for j, t in enumerate(dumped):
        scored = sorted((_rel_err(t, r), name) for name, r in reference.items() if tuple(r.shape) == tuple(t.shape))
        if not scored:
            out.append(TensorIdentity(j, None, note=f"no reference tensor of shape {list(t.shape)}", norm=_row_norm(t)))
            continue
        err, best = scored[0]
        ident = TensorIdentity(
            j,
            best if err < MATCH_REL_ERR else None,
            err,
            _cos(t, reference[best]),
            scored[1][1] if len(scored) > 1 else None,
            _row_norm(t),
        )
        if ident.name is None:
            ident.note = f"closest {short_name(best)} (relative error {err:.3g})"
        out.append(ident)
    ident = Identification(out, fc_count, "target", num_layers)
    names = [t.name for t in out]
    ks = [hidden_index(n) for n in names[:fc_count] if n]
    if len(ks) == fc_count and ks != sorted(ks):
        ident.notes.append("fc tensors are not in depth order (permuted)")
    if "target.h.0" in names[:fc_count]:
        ident.notes.append("the embedding (h0) is one of the fc inputs")
    if ident.verifier_is_final() is False:
        ident.notes.append(
            f"the trainer's verifier tensor is {ident.verifier.short()}, not the final layer: its targets are "
            "not the target model's predictions"
        )
    return ident


@torch.no_grad()
def identify_by_statistics(
    dumped: list[list[torch.Tensor]],  # per sample: the dumped tensors [n, H]
    token_ids: list[torch.Tensor],  # per sample [n]
    loss_masks: list[torch.Tensor],  # per sample [n] bool: where the text is the model's own
    fc_count: int,
    embed: torch.Tensor | None = None,  # [V, H] target input embedding
    lm_head: torch.Tensor | None = None,  # [V, H]
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    verifier_normed: bool = False,  # SpecForge: the verifier tensor is already after the final norm
) -> Identification:
    count = len(dumped[0])
    norms = [sum(_row_norm(s[j]) for s in dumped) / len(dumped) for j in range(count)]
    # a post-norm verifier takes lm_head directly (norming it again changes its top-1) and its norm
    # says nothing about depth, so it stays out of the depth-order check
    depth = list(range(fc_count)) if verifier_normed else list(range(count))
    out = [TensorIdentity(j, None, norm=norms[j]) for j in range(count)]
    notes = []
    for j in range(count):
        if embed is not None:
            err = sum(_rel_err(s[j], embed[ids].to(s[j].dtype)) for s, ids in zip(dumped, token_ids)) / len(dumped)
            if err < MATCH_REL_ERR:
                out[j].name, out[j].rel_err, out[j].note = "target.h.0", err, "equals embed(token) row by row"
        if lm_head is not None and norm_weight is not None:
            hit = tot = 0
            for s, ids, m in zip(dumped, token_ids, loss_masks):
                x = s[j][:-1].float()
                if not (verifier_normed and j == fc_count):
                    x = rms_norm(x, norm_weight, eps)
                pred = (x @ lm_head.float().T).argmax(-1)  # [n-1]
                use = m[1:].bool()  # position i predicts token i+1: count where token i+1 is model text
                hit += int((pred == ids[1:])[use].sum())
                tot += int(use.sum())
            out[j].top1_next = hit / tot if tot else None
    order = sorted(depth, key=lambda j: norms[j])
    if order[:fc_count] != list(range(fc_count)) or order != sorted(order):
        shown = ", ".join(f"{norms[j]:.3g}" for j in depth)
        notes.append(f"norms do not grow along the list ({shown}): the tensors are not in depth order")
    smallest = order[0]
    if embed is None and smallest < fc_count:
        notes.append(
            f"tensor {smallest} has the smallest norm ({norms[smallest]:.3g}): the embedding, if any, is there"
        )
    ident = Identification(out, fc_count, "statistics", None, notes)
    v = ident.verifier
    if v.top1_next is not None:
        best = max(range(count), key=lambda j: out[j].top1_next or 0.0)
        if v.top1_next < FINAL_TOP1:
            notes.append(
                f"verifier (tensor {fc_count}) lm_head(norm(x)) top-1 agrees with the data's next tokens on "
                f"{v.top1_next:.2f} of loss-masked positions; the final layer agrees on ~1.0 of model-generated text: "
                "not the final layer"
                + (f" (best: tensor {best}, {out[best].top1_next:.2f})" if best != fc_count else "")
            )
    return ident
