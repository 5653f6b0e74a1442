"""Structured output on an instance: each constrained request's grammar state (server/grammar.py)
and the allowed-token masks the sampler applies.

Prefill masks the first token; decode builds a request's `Constraint` when it adopts it (the
first token, which prefill sampled under the same grammar, is consumed), advances it over every
committed token, masks each plain decode step, and for a DFlash verify block masks every block
position (the matcher advanced over the drafts before it, then rolled back), so the committed
tokens follow the grammar whichever of them are accepted. The llguidance tokenizer is built on
the first constrained request: an instance that never sees one never loads it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from glm53.server.config import ClusterConfig
from glm53.server.grammar import Constraint, Grammars
from glm53.server.sampling import SamplingParams


class Constraints:
    def __init__(self, cluster: ClusterConfig):
        self.cluster = cluster
        self._grammars: Grammars | None = None

    def _g(self) -> Grammars:
        if self._grammars is None:
            from glm53.server.embedded_model import resolve_paths

            self._grammars = Grammars.from_model_dir(resolve_paths(self.cluster)[0])
        return self._grammars

    def new(self, params: SamplingParams) -> Constraint | None:
        if params.grammar is None:
            return None
        g = self._g()
        return Constraint(g.matcher(params.grammar), g.vocab_size, params.grammar_after)

    def first_masks(self, params: Sequence[SamplingParams], vocab: int) -> torch.Tensor | None:
        """The masks of the first output token (prefill), or None when no row is constrained."""
        if all(p.grammar is None for p in params):
            return None
        return masks([self.new(p) for p in params], vocab)


def _row(mask: torch.Tensor | None, vocab: int) -> torch.Tensor:
    if mask is None:
        return torch.ones(vocab, dtype=torch.bool)
    if mask.shape[0] >= vocab:
        return mask[:vocab]
    # Logit columns past the tokenizer's vocabulary (padding) are never allowed.
    return torch.cat([mask, torch.zeros(vocab - mask.shape[0], dtype=torch.bool)])


def masks(constraints: Sequence[Constraint | None], vocab: int) -> torch.Tensor | None:
    """Bool [B, vocab] for `sample(..., allowed=)`, or None when no row is constrained now."""
    rows = [c.allowed() if c is not None else None for c in constraints]
    if all(r is None for r in rows):
        return None
    return torch.stack([_row(r, vocab) for r in rows])


def mask_block(c: Constraint, drafts: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    """A verify block's logits [n+1, V] with each position's grammar mask applied."""
    rows = c.block_masks(list(drafts))
    if all(r is None for r in rows):
        return logits
    allowed = torch.stack([_row(r, logits.shape[-1]) for r in rows]).to(logits.device, non_blocking=True)
    return logits.masked_fill(~allowed, float("-inf"))
