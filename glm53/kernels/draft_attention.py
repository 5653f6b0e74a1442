"""DFlash draft attention over the paged `draft_kv` pool, read in place (no gathered context).

Semantics, per request r and KV head h (one draft layer `layer`):
- queries q [R, kv, M, hd]: the M = G·B query rows of KV head h (its G query heads times the B
  block positions; the draft's mask is the same for every query row of a request, so GQA query
  heads are just more rows);
- keys/values: the W·page_size context slots of the pages table[r, 0..W−1] in that order,
  K = pool[table[r, w], 2h, layer, s] and V = pool[table[r, w], 2h + 1, layer, s] (the pool is
  [pages, 2·kv, L, page_size, hd], heads interleaved K0 V0 K1 V1 …), followed by the block's own
  K/V k_blk[r, :, h], v_blk[r, :, h] ([R, B, kv, hd]);
- mask [R, W·page_size + B] bool: which of those W·page_size + B keys row r's queries see (as
  models/spec_state.py `draft_inputs` builds it). Hidden keys are never read: their values do not
  matter (NaN included), and neither do the page ids of pages whose slots are all hidden;
- o = softmax(q·Kᵀ · hd^−0.5 over the visible keys) · V, accumulated in fp32, returned
  [R, kv, M, hd] in q's dtype. Every row must see at least one key (the draft's block position 0
  always is); a row that sees none gets zeros from the kernel (and NaN from the reference).

`draft_attention` runs the Triton kernel (draft_attention_triton.py) where `dispatch.use_triton`
says so, the torch reference otherwise (it gathers one layer's pages). The CPU serving path
gathers every layer's context once per drafting forward instead (`gather_context`, then
`draft_attention_gathered` per layer): the same values, a fraction of the small ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm53.kernels.dispatch import use_triton


def check_shapes(q, pool, layer, table, k_blk, v_blk, mask) -> None:
    r, kv, _, hd = q.shape
    if pool.dim() != 5 or pool.shape[1] != 2 * kv or pool.shape[4] != hd or not 0 <= layer < pool.shape[2]:
        raise ValueError(f"pool {tuple(pool.shape)} is not [pages, 2·{kv}, L > {layer}, page_size, {hd}]")
    b = k_blk.shape[1]
    if k_blk.shape != (r, b, kv, hd) or v_blk.shape != k_blk.shape:
        raise ValueError(f"block K/V {tuple(k_blk.shape)}, {tuple(v_blk.shape)} are not [{r}, B, {kv}, {hd}]")
    if table.dim() != 2 or table.shape[0] != r:
        raise ValueError(f"page table {tuple(table.shape)} is not [{r}, W]")
    if mask.shape != (r, table.shape[1] * pool.shape[3] + b) or mask.dtype != torch.bool:
        raise ValueError(f"mask {tuple(mask.shape)} {mask.dtype} is not bool [{r}, W·page_size + {b}]")


def draft_attention_reference(q, pool, layer, table, k_blk, v_blk, mask) -> torch.Tensor:
    """The definition above in torch: this layer's pages gathered, the block appended, hidden keys
    zeroed (so garbage there cannot leak as NaN), fp32 SDPA with the mask."""
    r, kv, _, hd = q.shape
    w, ps = table.shape[1], pool.shape[3]
    pages = pool.select(2, layer)[table]  # [R, W, 2·kv, ps, hd]
    ctx = pages.permute(0, 2, 1, 3, 4).reshape(r, 2 * kv, w * ps, hd)
    k = torch.cat([ctx[:, 0::2], k_blk.transpose(1, 2)], dim=2)  # [R, kv, W·ps + B, hd]
    v = torch.cat([ctx[:, 1::2], v_blk.transpose(1, 2)], dim=2)
    keep = mask[:, None, :, None]
    k = torch.where(keep, k, 0).float()
    v = torch.where(keep, v, 0).float()
    o = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask[:, None, None, :], scale=hd**-0.5)
    return o.to(q.dtype)


def draft_attention(
    q: torch.Tensor, pool: torch.Tensor, layer: int, table: torch.Tensor, k_blk: torch.Tensor,
    v_blk: torch.Tensor, mask: torch.Tensor, num_splits: int | None = None, out: torch.Tensor | None = None,
    **knobs,
) -> torch.Tensor:
    """See the module docstring. `table` [R, W] integer page ids; `num_splits` and `knobs` (Triton
    only; None: the default plan) split each request's pages over programs and pick the schedule
    (draft_attention_triton.py); they change the speed, not the result beyond rounding. `out`: where
    the result goes ([R, kv, M, hd] in q's dtype, any strides with a unit last one: e.g. a view of
    the rows the output projection reads, which saves the caller a copy); returned. Device ops
    only: safe under CUDA graph capture."""
    check_shapes(q, pool, layer, table, k_blk, v_blk, mask)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not q's {tuple(q.shape)} {q.dtype} with a unit last stride")
    if use_triton(q):
        from glm53.kernels.draft_attention_triton import draft_attention_triton

        return draft_attention_triton(q, pool, layer, table, k_blk, v_blk, mask, num_splits, out=out, **knobs)
    o = draft_attention_reference(q, pool, layer, table, k_blk, v_blk, mask)
    return o if out is None else out.copy_(o)



def gather_context(pool: torch.Tensor, table: torch.Tensor, mask: torch.Tensor, block: int) -> torch.Tensor:
    """Every layer's context K and V of the pages `table` [R, W] at once, for a whole drafting
    forward: fp32 [2, L, kv, R, W·page_size + block, hd] (K at index 0, V at 1), context slots the
    mask [R, W·page_size + block] hides zeroed (garbage there, NaN included, cannot leak). The last
    `block` slots of each layer are left for `draft_attention_gathered` to fill with the block's
    own K/V. One `index_select` per request straight into the buffer and a zeroing of the hidden
    slots alone (reads the mask on the host: the CPU path): a broadcast masked fill or a permuting
    copy of the whole context costs several times more on a CPU."""
    r, w = table.shape
    n, nl, ps, hd = pool.shape[1], pool.shape[2], pool.shape[3], pool.shape[4]
    s = w * ps
    if mask.shape != (r, s + block) or mask.dtype != torch.bool:
        raise ValueError(f"mask {tuple(mask.shape)} {mask.dtype} is not bool [{r}, {s} + {block}]")
    # [pages, 2·kv, L, ps, hd] as [2, L, kv, pages, ps, hd]: the heads interleave K and V per KV head
    src = pool.view(pool.shape[0], n // 2, 2, nl, ps, hd).permute(2, 3, 1, 0, 4, 5)
    out = torch.empty(2, nl, n // 2, r, s + block, hd, dtype=torch.float32, device=pool.device)
    ctx = out[..., :s, :].view(2, nl, n // 2, r, w, ps, hd)
    for i in range(r):
        if src.dtype == torch.float32:
            torch.index_select(src, 3, table[i], out=ctx[:, :, :, i])
        else:
            ctx[:, :, :, i].copy_(src.index_select(3, table[i]))
    hidden = (~mask[:, :s]).nonzero()
    if len(hidden):
        out.permute(3, 4, 0, 1, 2, 5)[hidden[:, 0], hidden[:, 1]] = 0
    return out


def attention_bias(mask: torch.Tensor) -> torch.Tensor:
    """The additive fp32 form [R, 1, 1, S] (0 where seen, -inf where hidden) of the key mask
    [R, S] that SDPA would otherwise build from the bool mask on every call: built once per
    drafting forward for `draft_attention_gathered`."""
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias[:, None, None, :]


def draft_attention_gathered(q: torch.Tensor, kv: torch.Tensor, layer: int, k_blk: torch.Tensor,
                             v_blk: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`draft_attention` of layer `layer` over a `gather_context` buffer `kv`: writes the block's
    K/V ([R, B, kv, hd]) into that layer's last B slots, then attends (fp32) under `bias`, the
    key mask's `attention_bias`. Block keys the mask hides stay finite, so they contribute exact
    zeros, as the zeroed ones of the reference do."""
    b, hd = k_blk.shape[1], q.shape[-1]
    k, v = kv[0, layer].transpose(0, 1), kv[1, layer].transpose(0, 1)  # [R, kv, W·ps + B, hd]
    k[:, :, -b:].copy_(k_blk.transpose(1, 2))
    v[:, :, -b:].copy_(v_blk.transpose(1, 2))
    o = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=bias, scale=hd**-0.5)
    return o.to(q.dtype)
