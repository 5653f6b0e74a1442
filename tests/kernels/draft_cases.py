"""Checks of the paged DFlash draft attention (kernels/draft_attention.py), shared by the CPU
tests (the reference), the interpreter (the Triton kernel on CPU tensors) and the GPU tests.

Each check draws fresh random inputs and compares the public op with the torch reference in fp32
and with the formulation the draft used before the kernel (every layer's pages gathered, the
block appended with torch.cat, SDPA in the input dtype). Slots a request does not see hold NaN
in the pool the op reads, and pages with nothing visible point at an all-NaN page, so a value of
anything hidden that reaches the output shows up as NaN."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm53.kernels.draft_attention import draft_attention, draft_attention_reference


@dataclass
class Inputs:
    q: torch.Tensor
    pool: torch.Tensor  # finite everywhere (for the old formulation)
    pool_nan: torch.Tensor  # NaN wherever no request sees
    layer: int
    table: torch.Tensor
    k_blk: torch.Tensor
    v_blk: torch.Tensor
    mask: torch.Tensor


def make_inputs(spans, ns, kv, group, block, hd, page_size, width, dtype, device="cpu", layers=2) -> Inputs:
    """Requests r with context [spans[r][0], spans[r][1]) of positions 0 .. width·page_size − 1,
    block keys j < ns[r] visible; each request's pages drawn out of order from a shared pool."""
    r = len(spans)
    to = dict(device=device, dtype=dtype)
    num_pages = r * width + 2
    poison = num_pages - 1  # never anyone's page: stands for the garbage ids of hidden pages
    table = torch.randperm(num_pages - 1, device=device)[: r * width].view(r, width).clone()
    pos = torch.arange(width * page_size, device=device)
    ctx = torch.stack([(pos >= a) & (pos < b) for a, b in spans])
    blk = torch.stack([torch.arange(block, device=device) < n for n in ns])
    table[~ctx.view(r, width, page_size).any(dim=2)] = poison
    pool = torch.randn(num_pages, 2 * kv, layers, page_size, hd, **to)
    seen = torch.zeros(num_pages, page_size, dtype=torch.bool, device=device)
    seen[table.flatten()] = ctx.view(r * width, page_size)
    seen[poison] = False
    pool_nan = torch.where(seen[:, None, None, :, None], pool, float("nan"))
    q = torch.randn(r, kv, group * block, hd, **to)
    kb, vb = torch.randn(r, block, kv, hd, **to), torch.randn(r, block, kv, hd, **to)
    return Inputs(q, pool, pool_nan, layers - 1, table, kb, vb, torch.cat([ctx, blk], dim=1))


def old_formulation(x: Inputs) -> torch.Tensor:
    """What DraftAttention did before the kernel: gather [R, W·ps, 2·kv, L, hd] of every layer,
    append the block, SDPA with the key mask in the input dtype."""
    pages = x.pool[x.table]  # [R, W, 2·kv, L, ps, hd]
    r, w, h2, nl, ps, hd = pages.shape
    ctx = pages.permute(0, 1, 4, 2, 3, 5).reshape(r, w * ps, h2, nl, hd)
    k = torch.cat([ctx[..., 0::2, x.layer, :], x.k_blk], dim=1).transpose(1, 2)
    v = torch.cat([ctx[..., 1::2, x.layer, :], x.v_blk], dim=1).transpose(1, 2)
    return F.scaled_dot_product_attention(x.q, k, v, attn_mask=x.mask[:, None, None, :], scale=hd**-0.5)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "NaN/inf in the output: something hidden was read"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_draft_attention(spans, ns, kv, group, block, hd, page_size, width, dtype, device="cpu",
                          **knobs) -> None:
    x = make_inputs(spans, ns, kv, group, block, hd, page_size, width, dtype, device)
    args = (x.q, x.pool_nan, x.layer, x.table, x.k_blk, x.v_blk, x.mask)
    out = draft_attention(*args, **knobs)
    ref = draft_attention_reference(*args)
    old = old_formulation(x)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _err(out, ref) <= tol, _err(out, ref)
    assert _err(out, old) <= 2 * tol, _err(out, old)
    # a row with no visible context equals attention over its block keys alone
    for i, (a, b) in enumerate(spans):
        if a == b:
            n = ns[i]
            k, v = x.k_blk[i, :n].transpose(0, 1).float(), x.v_blk[i, :n].transpose(0, 1).float()
            alone = F.scaled_dot_product_attention(x.q[i].float(), k, v, scale=hd**-0.5).to(dtype)
            assert _err(out[i], alone) <= tol
