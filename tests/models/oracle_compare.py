"""What the model core's comparisons against the oracle (transformers, glm53.support.oracle)
share: the index top-k of their checkpoints (`TOPK`), a probe that makes sure no index-score
near-tie decides the comparison (`IndexGapProbe`), the oracle's top-k with our tie rule where
exact ties are the point (`stable_topk`), and the relative error (`rel_err`). Used by
test_against_transformers.py and test_stages.py."""

from __future__ import annotations

from contextlib import contextmanager

import torch

import glm53.models.model as model_mod
from glm53.kernels.indexer_logits import gather_paged
from glm53.kernels.rope import apply_rope

TOPK = 8


class IndexGapProbe:
    """Wraps the indexer-logits op and checks, on every row longer than k, that the gap between
    the k-th and (k+1)-th scores is far above that row's fp32 rounding error (measured against
    the same scores in float64). Otherwise two fp32 implementations could break a near-tie
    differently and the oracle comparison would be ill-posed."""

    def __init__(self, monkeypatch, k: int):
        self.k, self.min_ratio, self.rows = k, float("inf"), 0
        inner = model_mod.indexer_logits

        def probe(q, w, cache, table, lengths, max_len, rope=None):
            if rope is not None:  # the op reads q rotated (`indexer_logits(rope=)`): check on that q
                cos, sin, interleave = rope
                r = 2 * cos.shape[1]
                q = q.clone()
                apply_rope(q[..., :r], cos, sin, interleave, out=q[..., :r])
            out = inner(q, w, cache, table, lengths, max_len)
            rows = lengths > self.k
            if rows.any():
                keys = gather_paged(cache, table[rows], max_len).double()
                dots = torch.einsum("thd,tsd->ths", q[rows].double(), keys).relu()
                exact = torch.einsum("th,ths->ts", w[rows].double(), dots)
                got = out[rows].double()
                valid = torch.isfinite(got)
                err = torch.where(valid, got - exact, torch.zeros_like(exact)).abs().amax(-1)
                s = got.sort(dim=-1, descending=True).values
                gap = s[:, self.k - 1] - s[:, self.k]
                self.min_ratio = min(self.min_ratio, float((gap / err.clamp_min(1e-300)).min()))
                self.rows += int(rows.sum())
            return out

        monkeypatch.setattr(model_mod, "indexer_logits", probe)

    def assert_well_posed(self) -> None:
        assert self.rows > 0 and self.min_ratio > 20, (
            f"index-score near-tie: k-th/(k+1)-th gap only {self.min_ratio:.1f}x the rounding error"
        )


@contextmanager
def stable_topk():
    """Within the block, `Tensor.topk` over floats breaks ties by lowest position (our contract,
    `kernels/topk.py`): the oracle's `topk` leaves tied scores' order unspecified, so where index
    scores tie exactly at the k-th place the two selections may differ without either being wrong."""
    inner = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        if not (largest and self.dtype.is_floating_point):
            return inner(self, k, dim=dim, largest=largest, sorted=sorted)
        idx = torch.sort(self, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, idx), idx))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = inner


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())
