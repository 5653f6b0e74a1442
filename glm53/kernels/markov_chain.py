"""DSpark's greedy Markov chain (models/dspark.py): block position i's proposal is
argmax_v(base[i, v] + markov_w2[v] · markov_w1[token_{i−1}]), decoded left to right from the
anchor. The Triton kernel (`markov_chain_triton.py`, one launch a position) where `use_triton`
says so, else the torch reference (four kernels a position)."""

from __future__ import annotations

import torch

from glm53.kernels.dispatch import use_triton


def markov_chain(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """base [R, n, V] fp32: the draft's logits at block positions 1 .. n; anchor [R] long (block
    token 0); w1, w2 [V, r] -> the greedy tokens [R, n] long."""
    r = w1.shape[1]
    if use_triton(base, w1, w2) and r & (r - 1) == 0 and base.stride(2) == 1:
        from glm53.kernels.markov_chain_triton import markov_chain_triton

        return markov_chain_triton(base, anchor, w1, w2)
    return markov_chain_reference(base, anchor, w1, w2)


def markov_chain_reference(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
                           ) -> torch.Tensor:
    w1, w2t = w1.float(), w2.float().T  # cast once per block (in a bf16 graph a cast is a kernel)
    prev, toks = anchor, []
    for i in range(base.shape[1]):  # left to right: position i sees the token chosen at i − 1
        prev = (base[:, i] + w1[prev] @ w2t).argmax(dim=-1)
        toks.append(prev)
    return torch.stack(toks, dim=1) if toks else anchor.new_empty((base.shape[0], 0))
