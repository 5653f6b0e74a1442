"""What the model core's comparisons against the oracle (transformers, glm53.support.oracle)
share: the index top-k of their checkpoints (`TOPK`), a probe that makes sure no index-score
near-tie decides the comparison (`IndexGapProbe`), the oracle's top-k with our tie rule where
exact ties are the point (`stable_topk`), the relative error (`rel_err`), and random tiny
configs for sweeps (`random_config`). Used by test_against_transformers.py, test_stages.py and
tools/oracle_sweep.py."""

from __future__ import annotations

import random
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


def random_config(seed: int) -> tuple[dict, int, list[int]]:
    """A random tiny GLM-5-family config (overrides of `oracle.BASE`), a page size and three
    prompt lengths (shorter than index_topk, ~3x, 4-10x), all drawn from `seed`: 2-6 layers,
    hidden 32-96, 1-8 heads, rope 4-16, nope 8-24, v 8-40, latent 16-40, q rank 16-48, index
    top-k 4-32 with 1-32 index heads 16-64 wide, 2-16 experts in 1-4 groups, top 1-4, 1-2 shared,
    dense prefixes, index sharing every 1-4 layers, tied embeddings, both routing normalizations,
    eps and rope theta; pages of 1, 4 or 16 tokens."""
    r = random.Random(seed)
    heads, groups, layers = r.choice([1, 2, 3, 4, 6, 8]), r.choice([1, 2, 4]), r.randint(2, 6)
    experts = groups * r.choice([2, 3, 4])
    cfg = dict(num_hidden_layers=layers, hidden_size=r.choice([32, 48, 64, 80, 96]), num_attention_heads=heads,
               num_key_value_heads=heads, kv_lora_rank=r.choice([16, 24, 32, 40]), q_lora_rank=r.choice([16, 24, 48]),
               qk_rope_head_dim=r.choice([4, 8, 16]), qk_nope_head_dim=r.choice([8, 12, 16, 24]),
               v_head_dim=r.choice([8, 16, 24, 40]), index_topk=r.choice([4, 8, 16, 32]),
               index_head_dim=r.choice([16, 32, 64]), index_n_heads=r.choice([1, 4, 8, 16, 32]),
               n_routed_experts=experts, n_group=groups, topk_group=r.randint(1, groups),
               num_experts_per_tok=r.randint(1, min(4, experts)), n_shared_experts=r.choice([1, 2]),
               first_k_dense_replace=r.randint(0, min(2, layers - 1)), moe_intermediate_size=r.choice([16, 32, 48]),
               routed_scaling_factor=r.choice([1.0, 2.5]), norm_topk_prob=r.choice([True, False]),
               tie_word_embeddings=r.random() < 0.2, rms_norm_eps=r.choice([1e-5, 1e-6]),
               index_topk_freq=r.randint(1, 4), index_skip_topk_offset=r.randint(1, 3),
               rope_parameters={"rope_theta": r.choice([1e4, 1e6]), "rope_type": "default"})
    # enough groups kept for the experts a token picks (else the config is refused at load)
    cfg["topk_group"] = max(cfg["topk_group"], -(-cfg["num_experts_per_tok"] // (experts // groups)))
    page, k = r.choice([1, 4, 16]), cfg["index_topk"]
    return cfg, page, [max(1, k - 3), 3 * k + 1, r.randint(4, 10) * k]
