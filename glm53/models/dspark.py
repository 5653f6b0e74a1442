"""DSpark's heads on top of the DFlash draft, and how a block's proposals are chosen.

A DFlash draft scores every block position at once (the block [anchor, MASK × (B − 1)] attends to
itself non-causally), so its proposals are independent per position. DSpark adds:
- a low-rank Markov head: `markov_w1` [V, r] embeds the previous block token, `markov_w2` [V, r]
  maps that back to the vocabulary, and position i's logits become
  `base_i + markov_w2 · markov_w1[token_{i−1}]`; the block is decoded left to right from the
  anchor (token 0, the last committed token), so each position sees the token chosen before it;
- an optional confidence head: `sigmoid(proj([h_i, markov_w1[token_{i−1}]]))`, h_i the draft's
  final-normed hidden at position i (what the lm_head reads); the block ends before the first
  position below the threshold (no cut at threshold 0 or without the head).

`choose_block` is the one place proposals are picked, for both drafts: argmax, or (rows with a
`BlockSampling`) a sample from the draft's own distribution q — temperature, top-k, top-p and
min-p applied as the target's sampler applies them — drawn by inverse CDF from uniforms the
caller supplies, so a seeded request drafts the same tokens on every rank and every run. Device
ops only and a fixed loop length: CUDA graphs capture it, and a block the confidence cut makes
shorter is only a smaller `keep` (no recapture).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from glm53.kernels.markov_chain import confidence_keep, markov_chain, markov_chain_keep
from glm53.kernels.sampling_filter import filter_logits
from glm53.models.layers import param


class MarkovHead(nn.Module):
    """`markov_head.markov_w1.weight` and `markov_head.markov_w2.weight`, both [V, r]
    (replicated: small, and every rank must pick the same tokens)."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype):
        super().__init__()
        self.markov_w1 = nn.Module()
        self.markov_w1.weight = param(vocab, rank, dtype=dtype)
        self.markov_w2 = nn.Module()
        self.markov_w2.weight = param(vocab, rank, dtype=dtype)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(markov_w1 [V, r], markov_w2ᵀ [r, V]) in fp32: cast once per block, not once per
        position (in a bf16 graph each cast is a kernel over the whole [V, r] weight)."""
        return self.markov_w1.weight.float(), self.markov_w2.weight.float().T


class ConfidenceHead(nn.Module):
    """`confidence_head.proj` (weight [1, H + r], bias [1]); its confidences and the cut they make
    are `kernels/markov_chain.confidence_keep`."""

    def __init__(self, hidden: int, rank: int, dtype: torch.dtype):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = param(1, hidden + rank, dtype=dtype)
        self.proj.bias = param(1, dtype=dtype)


@dataclass
class BlockSampling:
    """The sampled rows of a block batch, as device tensors: which rows sample (`rows` [R] bool),
    their temperature, top-k (V: none), top-p, min-p ([R] each; the greedy rows' values are
    placeholders) and one uniform per block position ([R, B − 1] fp64). `sort` / `use_min_p`:
    whether any row filters by top-k or top-p / by min-p (decided on the host)."""

    rows: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    uniforms: torch.Tensor
    sort: bool = True
    use_min_p: bool = True


@dataclass
class BlockChoice:
    """A batch of blocks' proposals: `tokens` [R, B − 1] long; `keep` [R] long, the leading
    proposals the confidence cut keeps (all without a cut); `probs` [R, B − 1, V] fp32, each
    sampled row's q per position (None when no row samples; greedy rows' rows are unused)."""

    tokens: torch.Tensor
    keep: torch.Tensor
    probs: torch.Tensor | None = None


def draft_probs(logits: torch.Tensor, s: BlockSampling) -> torch.Tensor:
    """q = softmax(filter(logits / T)) per row: logits [R, ..., V] fp32."""
    shape = logits.shape
    x = logits.reshape(shape[0], -1, shape[-1])
    t = torch.where(s.rows, s.temperature, 1.0).clamp_min(1e-6)
    x = x / t[:, None, None]
    n = x.shape[1]
    rep = lambda v: v.repeat_interleave(n)  # noqa: E731 — one filter row per (request, position)
    x = x.reshape(-1, shape[-1])
    if s.sort or s.use_min_p:
        x = filter_logits(x, rep(s.top_k), rep(s.top_p), rep(s.min_p), sort=s.sort, use_min_p=s.use_min_p)
    return torch.softmax(x, dim=-1).view(shape)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A token of each row of `probs` [..., V] for the uniforms `u` [...] in [0, 1): the first
    token whose cumulative mass exceeds u (zero-mass tokens are never chosen)."""
    cdf = probs.double().cumsum(dim=-1)
    tok = (cdf <= u[..., None]).sum(dim=-1)
    # Rounding can leave u at or above the last cumulative sum: the last token with mass then.
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
    return torch.minimum(tok, last)


def choose_block(logits: torch.Tensor, anchor: torch.Tensor, hidden: torch.Tensor | None = None,
                 markov: MarkovHead | None = None, confidence: ConfidenceHead | None = None,
                 threshold: float = 0.0, sampling: BlockSampling | None = None) -> BlockChoice:
    """Proposals for blocks whose draft logits are `logits` [R, B − 1, V] (positions 1 .. B − 1;
    fp32, or the lm_head's dtype, whose argmax and Markov scores are its fp32 cast's), anchored
    at `anchor` [R] (block token 0). `hidden` [R, B − 1, H]: the final-normed draft hidden
    (needed by the confidence head)."""
    r, n, _ = logits.shape
    if sampling is not None:  # q's arithmetic in fp32
        logits = logits.float()
    if markov is None:  # DFlash: every position on its own
        tokens = logits.argmax(dim=-1)
        probs = None
        if sampling is not None:
            probs = draft_probs(logits, sampling)
            tokens = torch.where(sampling.rows[:, None], inverse_cdf(probs, sampling.uniforms), tokens)
        return BlockChoice(tokens, torch.full((r,), n, dtype=torch.long, device=logits.device), probs)
    cut = confidence is not None and threshold > 0
    if cut and hidden is None:
        raise ValueError("the confidence head needs the draft's hidden states")
    probs = []
    w1 = markov.markov_w1.weight
    if sampling is None and cut:  # the chain, then the cut, made by the chain's last launch on a GPU
        tokens, keep = markov_chain_keep(logits, anchor, w1, markov.markov_w2.weight, hidden, confidence.proj.weight,
                                         confidence.proj.bias, threshold)
        return BlockChoice(tokens, keep)
    if sampling is None:  # greedy: the chain alone (on a GPU one kernel launch a position)
        tokens = markov_chain(logits, anchor, w1, markov.markov_w2.weight)
    else:
        prev, toks = anchor, []
        w1f, w2t = markov.tables()
        for i in range(n):  # left to right: position i sees the token chosen at i − 1
            lg = logits[:, i] + w1f[prev] @ w2t  # base_i + markov_w2 · markov_w1[token_{i−1}]
            q = draft_probs(lg[:, None], sampling)[:, 0]
            prev = torch.where(sampling.rows, inverse_cdf(q, sampling.uniforms[:, i]), lg.argmax(dim=-1))
            toks.append(prev)
            probs.append(q)
        tokens = torch.stack(toks, dim=1)
    if cut:
        # Every position's confidence once the chain is known (its inputs are), in one op: the
        # leading positions at or above the threshold; the block ends before the first below it.
        keep = confidence_keep(hidden, anchor, tokens, w1, confidence.proj.weight, confidence.proj.bias, threshold)
    else:
        keep = torch.full((r,), n, dtype=torch.long, device=logits.device)
    return BlockChoice(tokens, keep, torch.stack(probs, dim=1) if probs else None)
