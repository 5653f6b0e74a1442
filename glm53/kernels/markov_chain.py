"""DSpark's greedy block (models/dspark.py). The Markov chain: block position i's proposal is
argmax_v(base[i, v] + markov_w2[v] · markov_w1[token_{i−1}]), decoded left to right from the
anchor. The confidence cut: position i's confidence is sigmoid(proj([h_i, markov_w1[token_{i−1}]])),
and the block keeps the proposals before the first one below the threshold. The Triton kernels
(`markov_chain_triton.py`: one launch a position for the chain, one for the cut) where
`use_triton` says so, else the torch references (four kernels a position; ~14 for the cut).
`markov_chain_keep`: both, the cut made by the chain's last launch."""

from __future__ import annotations

import torch

from glm53.kernels.dispatch import use_triton


def _chain_on_triton(base: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the chain runs as the Triton kernels (`markov_chain` and `markov_chain_keep` alike)."""
    r = w1.shape[1]
    return use_triton(base, w1, w2) and r & (r - 1) == 0 and base.stride(2) == 1


def markov_chain(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """base [R, n, V]: the draft's logits at block positions 1 .. n, fp32 or the lm_head's dtype
    (the sums run in fp32 either way, so a bf16 base gives what its fp32 cast would); anchor [R]
    long (block token 0); w1, w2 [V, r] -> the greedy tokens [R, n] long."""
    if _chain_on_triton(base, w1, w2):
        from glm53.kernels.markov_chain_triton import markov_chain_triton

        return markov_chain_triton(base, anchor, w1, w2)
    return markov_chain_reference(base, anchor, w1, w2)


def markov_chain_reference(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
                           ) -> torch.Tensor:
    # cast once per block (in a bf16 graph a cast is a kernel)
    w1, w2t, base = w1.float(), w2.float().T, base.float()
    prev, toks = anchor, []
    for i in range(base.shape[1]):  # left to right: position i sees the token chosen at i − 1
        prev = (base[:, i] + w1[prev] @ w2t).argmax(dim=-1)
        toks.append(prev)
    return torch.stack(toks, dim=1) if toks else anchor.new_empty((base.shape[0], 0))


def markov_chain_keep(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      hidden: torch.Tensor, proj_w: torch.Tensor, proj_b: torch.Tensor, threshold: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(`markov_chain`'s tokens, `confidence_keep` of them): on the Triton path one launch fewer
    (the cut in the chain's last launch), the same values as the two ops."""
    if _chain_on_triton(base, w1, w2) and use_triton(hidden, proj_w) and hidden.stride(2) == 1:
        from glm53.kernels.markov_chain_triton import markov_chain_keep_triton

        return markov_chain_keep_triton(base, anchor, w1, w2, hidden, proj_w, proj_b, threshold)
    tokens = markov_chain(base, anchor, w1, w2)
    return tokens, confidence_keep(hidden, anchor, tokens, w1, proj_w, proj_b, threshold)


def confidence_keep(hidden: torch.Tensor, anchor: torch.Tensor, tokens: torch.Tensor, w1: torch.Tensor,
                    proj_w: torch.Tensor, proj_b: torch.Tensor, threshold: float) -> torch.Tensor:
    """hidden [R, n, H] (the final-normed draft hidden of positions 1 .. n), anchor [R], tokens
    [R, n] long (the chain's), w1 [V, r], proj_w [1, H + r], proj_b [1] -> keep [R] long: the
    leading positions whose confidence is at or above `threshold`."""
    if use_triton(hidden, w1, proj_w) and hidden.stride(2) == 1 and tokens.is_contiguous():
        from glm53.kernels.markov_chain_triton import confidence_keep_triton

        return confidence_keep_triton(hidden, anchor, tokens, w1, proj_w, proj_b, threshold)
    return confidence_keep_reference(hidden, anchor, tokens, w1, proj_w, proj_b, threshold)


def confidence_keep_reference(hidden: torch.Tensor, anchor: torch.Tensor, tokens: torch.Tensor, w1: torch.Tensor,
                              proj_w: torch.Tensor, proj_b: torch.Tensor, threshold: float) -> torch.Tensor:
    before = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)  # token_{i−1} of each position
    x = torch.cat([hidden.float(), w1[before].float()], dim=-1)  # [h_i, markov_w1[token_{i−1}]]
    conf = torch.sigmoid(x @ proj_w.float().T + proj_b.float()).squeeze(-1)
    return (conf >= threshold).long().cumprod(dim=1).sum(dim=1)
