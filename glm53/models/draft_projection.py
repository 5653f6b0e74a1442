"""The draft's feature projection, Σ_k W_k h_k over the target layers `target_layer_ids`, in fp32:
split by column blocks so that each pipeline stage adds the blocks of the layers it owns
(docs/ARCHITECTURE.md, "Capture and partial projection"); the last stage's draft adds its own and
normalises (`DFlashDraft.context`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from glm53.models.draft import DFlashDraft


def project_features(
    weight: torch.Tensor, ids: tuple[int, ...], captures: Mapping[int, torch.Tensor], acc: torch.Tensor | None
) -> torch.Tensor:
    """acc + Σ W_k h_k over the ids present in `captures`, in `ids` order, accumulated in fp32.
    `weight` holds the column blocks of `ids` ([H, len(ids)·H]). Each block's product is added
    on its own, so splitting the ids over stages gives the same bits as one stage."""
    extra = sorted(set(captures) - set(ids))
    if extra:
        raise ValueError(f"captured layers {extra} are not draft features here (ids {list(ids)})")
    h = weight.shape[0]
    for k, layer in enumerate(ids):
        if layer not in captures:
            continue
        part = F.linear(captures[layer].to(weight.dtype), weight[:, k * h : (k + 1) * h]).float()
        acc = part if acc is None else acc + part
    if acc is None:
        raise ValueError("no feature captured and no accumulator given: nothing to project")
    return acc


def feature_parts(weight: torch.Tensor, ids: tuple[int, ...], captures: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """The products W_k h_k of the ids present in `captures`, in `ids` order, as one tensor [P, N, H]
    in the weight's dtype (each written in place: no stack): what `project_features` sums."""
    extra = sorted(set(captures) - set(ids))
    if extra:
        raise ValueError(f"captured layers {extra} are not draft features here (ids {list(ids)})")
    ks = [k for k, layer in enumerate(ids) if layer in captures]
    if not ks:
        raise ValueError("no feature captured: nothing to project")
    h = weight.shape[0]
    first = captures[ids[ks[0]]]
    parts = torch.empty(len(ks), first.shape[0], h, dtype=weight.dtype, device=weight.device)
    for p, k in enumerate(ks):
        torch.matmul(captures[ids[k]].to(weight.dtype), weight[:, k * h : (k + 1) * h].T, out=parts[p])
    return parts


class DraftProjection(nn.Module):
    """The `fc` column blocks of some of the draft's feature layers: what a pipeline stage that
    owns target layers `ids` (but not the draft) adds into the accumulator it hands on."""

    def __init__(self, weight: torch.Tensor, ids: tuple[int, ...]):
        super().__init__()
        if weight.shape[1] != len(ids) * weight.shape[0]:
            raise ValueError(f"weight {tuple(weight.shape)} does not hold {len(ids)} column blocks")
        self.ids = tuple(ids)
        self.weight = nn.Parameter(weight, requires_grad=False)

    @classmethod
    def of_draft(cls, draft: "DFlashDraft", layers: range) -> "DraftProjection":
        """The blocks of `draft.fc` for the feature ids within the target layers `layers`."""
        ks = [k for k, i in enumerate(draft.cfg.target_layer_ids) if i in layers]
        h = draft.cfg.hidden_size
        w = torch.cat([draft.fc.weight[:, k * h : (k + 1) * h] for k in ks], dim=1) if ks else draft.fc.weight[:, :0]
        return cls(w.clone(), tuple(draft.cfg.target_layer_ids[k] for k in ks))

    def partial_projection(self, captures: Mapping[int, torch.Tensor], acc: torch.Tensor | None = None) -> torch.Tensor:
        return project_features(self.weight, self.ids, captures, acc)
