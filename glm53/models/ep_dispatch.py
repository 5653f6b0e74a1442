"""The expert-parallel MoE's token exchange: pairs go to their experts' ranks and come back through
two all-to-alls on the tensor-parallel group (docs/ARCHITECTURE.md, "Expert parallelism").

Every rank enters with the same x [N, H] (the attention's all-reduce made it identical) and the
same routing (the router is replicated), so no routing metadata travels: each rank derives from
the replicated ids what every rank sends and receives.

- Tokens are split into `tp` contiguous slices (sizes differing by at most one); rank s dispatches
  the (token, slot) pairs of slice s, so every pair is computed once in the group.
- A pair whose expert lies in expert group g goes to each of the group's m = tp / ep ranks (each
  holds a part of the expert's intermediate width, `expert_parallel`): one row of x per pair and
  rank, in (token, slot) order per destination. A rank receives, from each source in rank order,
  the pairs of that source's slice whose expert is in its group, in (token, slot) order: exactly
  the pairs of its group in the replicated ids, read in order, so it knows their experts and
  routing weights without being told.
- It runs its experts on those rows (the same kernels as tensor parallelism, `experts`, with k = 1:
  the routing weight is applied in the kernel) and sends each row back to where it came from.
- The source sums each token's k·m returned rows in fp32, in slot order (deterministic), into its
  slice's rows of an [N, H] output that is zero elsewhere. The caller adds the shared experts'
  partial output and all-reduces once, as without EP: the slices are disjoint, so the all-reduce
  assembles the routed output on every rank and sums the shared experts' parts.

Host syncs: one per MoE layer (the [tp, ep] pair counts, which all_to_all_single needs as host
lists), so an EP step is not CUDA-graph capturable; tp > 1 decode runs eagerly anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from glm53.models.expert_parallel import ExpertPlacement
from glm53.models.parallel import TPGroup
from glm53.models.readback import readback

# (x [R, H], weights [R, 1] fp32, local expert ids [R, 1]) -> [R, H]: this rank's experts, weighted.
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def token_bounds(n: int, size: int) -> list[int]:
    """Slice s of n tokens over `size` ranks is [bounds[s], bounds[s + 1])."""
    return [s * n // size for s in range(size + 1)]


@dataclass(frozen=True)
class Exchange:
    """One MoE layer's exchange as seen from one rank (`plan_exchange`)."""

    lo: int  # this rank's token slice [lo, hi)
    hi: int
    copies: int  # k·m: rows sent per token of the slice (each slot to each rank of its group)
    send_order: torch.Tensor  # [n_slice·k·m] the slice's (token, slot, copy) rows in send order
    send_tokens: torch.Tensor  # [n_slice·k·m] the token (global row of x) of each row sent
    send: list[int]  # rows to each rank
    recv: list[int]  # rows from each rank
    recv_ids: torch.Tensor  # [sum(recv)] local expert id of each row received
    recv_weights: torch.Tensor  # [sum(recv)] fp32 routing weight of each row received


def plan_exchange(weights: torch.Tensor, ids: torch.Tensor, pl: ExpertPlacement) -> Exchange:
    """From the replicated routing (weights, ids [N, k]) what this rank sends and receives."""
    n, k = ids.shape
    tp, m, ep, per = pl.tp, pl.width_parts, pl.ep, pl.experts_per_group
    dev = ids.device
    bounds = token_bounds(n, tp)
    owner = ids.long() // per  # [N, k] the expert group of each pair
    sizes = torch.tensor([bounds[s + 1] - bounds[s] for s in range(tp)], device=dev)
    slice_of = torch.repeat_interleave(torch.arange(tp, device=dev), sizes)  # [N]
    # counts[s][g]: pairs of slice s whose expert is in group g (identical on every rank)
    pairs = torch.bincount((slice_of[:, None] * ep + owner).flatten(), minlength=tp * ep).view(tp, ep)
    counts = readback(pairs).tolist()
    send = [counts[pl.rank][d // m] for d in range(tp)]
    recv = [counts[s][pl.group] for s in range(tp)]

    lo, hi = bounds[pl.rank], bounds[pl.rank + 1]
    # rows (token, slot, copy i) of the slice, destination group·m + i, stably sorted by destination
    dest = (owner[lo:hi, :, None] * m + torch.arange(m, device=dev)).flatten()
    order = torch.argsort(dest, stable=True)
    send_tokens = lo + torch.div(order, k * m, rounding_mode="floor")
    # The pairs of this rank's group in (token, slot) order, which is source-rank order. A stable
    # sort puts them first with no data-dependent shape (nonzero would be a second host sync).
    mine = owner.flatten() == pl.group
    sel = torch.argsort((~mine).to(torch.int8), stable=True)[: sum(recv)]
    return Exchange(
        lo=lo, hi=hi, copies=k * m, send_order=order, send_tokens=send_tokens, send=send, recv=recv,
        recv_ids=ids.flatten()[sel].long() - pl.experts.start, recv_weights=weights.flatten()[sel].float(),
    )


def ep_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, pl: ExpertPlacement, tp: TPGroup,
           experts: ExpertsFn) -> torch.Tensor:
    """The routed experts' output for this rank's token slice, in an [N, H] tensor of x's dtype
    that is zero outside the slice (module docstring); the caller all-reduces it."""
    n, h = x.shape
    ex = plan_exchange(weights, ids, pl)
    rows = tp.all_to_all(x[ex.send_tokens], ex.send, ex.recv)
    if rows.shape[0]:
        y = experts(rows, ex.recv_weights[:, None], ex.recv_ids[:, None])
    else:  # nothing routed here this step (the kernels' references need at least one row)
        y = rows
    back = tp.all_to_all(y, ex.recv, ex.send)
    per_row = torch.empty_like(back)
    per_row[ex.send_order] = back  # (token, slot, copy) order again
    out = x.new_zeros(n, h)
    out[ex.lo : ex.hi] = per_row.view(ex.hi - ex.lo, ex.copies, h).sum(1, dtype=torch.float32).to(x.dtype)
    return out
