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
from glm53.kernels.norm import rms_norm
from glm53.kernels.norm_triton import rms_norm_triton
from glm53.kernels.qk_heads import (
    finish_qk_heads, finish_qk_heads_reference, store_context_kv, store_context_kv_reference,
)
from glm53.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq
from glm53.kernels.rope_triton import apply_rope_triton


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
                          into_rows: bool = False, **knobs) -> None:
    """`into_rows`: the output written through `out` into the rows o_proj reads ([R·B, kv·hd],
    group 1 only), as the draft layer does."""
    x = make_inputs(spans, ns, kv, group, block, hd, page_size, width, dtype, device)
    args = (x.q, x.pool_nan, x.layer, x.table, x.k_blk, x.v_blk, x.mask)
    if into_rows:
        r = len(spans)
        rows = torch.full((r * block, kv * hd), float("nan"), dtype=dtype, device=device)
        view = rows.view(r, block, kv, hd).transpose(1, 2)
        assert draft_attention(*args, out=view, **knobs).data_ptr() == rows.data_ptr()
        out = view.contiguous()
    else:
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


def check_qk_heads(r, block, hq, hk, hd, dtype, device="cpu", fused: bool = True) -> None:
    """`finish_qk_heads` on q and k as members of one q|k|v product (strided rows, padding after
    v) or as products of their own: bit for bit the norm and rope kernels in turn (the path it
    replaces, on the same device), and close to the torch reference; V and the padding untouched,
    K finished in place."""
    n = r * block
    y = torch.randn(n, (hq + 2 * hk) * hd + 8, device=device).mul_(3).to(dtype)
    if not fused:  # separate products: contiguous q and k
        y = y[:, : (hq + 2 * hk) * hd].contiguous()
    y0 = y.clone()
    q, k = y[:, : hq * hd], y[:, hq * hd : (hq + hk) * hd]
    qw, kw = (torch.randn(hd, device=device).to(dtype) for _ in range(2))
    cos, sin = rope_cos_sin(torch.randint(0, 200_000, (n,), device=device), rope_inv_freq(hd, 1e6, device))
    out = finish_qk_heads(q, k, qw, kw, 1e-6, cos, sin, block)

    g = hq // hk
    qh = apply_rope_triton(rms_norm_triton(y0[:, : hq * hd].contiguous().view(n, hq, hd), qw, 1e-6), cos, sin, False)
    kh = apply_rope_triton(rms_norm_triton(y0[:, hq * hd : (hq + hk) * hd].contiguous().view(n, hk, hd), kw, 1e-6),
                           cos, sin, False)
    want_q = qh.view(r, block, hk, g, hd).permute(0, 2, 3, 1, 4).reshape(r, hk, g * block, hd)
    assert out.shape == (r, hk, g * block, hd) and out.is_contiguous()
    assert torch.equal(out, want_q)
    assert torch.equal(k, kh.view(n, hk * hd))
    assert torch.equal(y[:, (hq + hk) * hd :], y0[:, (hq + hk) * hd :]), "V or the padding changed"

    q2, k2 = y0[:, : hq * hd].float(), y0[:, hq * hd : (hq + hk) * hd].float()
    ref_q = finish_qk_heads_reference(q2, k2, qw.float(), kw.float(), 1e-6, cos, sin, block)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k.float(), k2, rtol=tol, atol=tol)


def ops_block_hidden(draft, target, ids, positions, ctx, products=None) -> torch.Tensor:
    """`DFlashDraft.block_hidden` on its modules' path as separate ops: each projection, norm and
    rotation, the queries' copy, the attention's output copied, each residual add on its own; the
    form before `qk_heads`, the fused q|k|v product and the adds inside the norms."""
    r, b = ids.shape
    x = target.embed(ids.reshape(-1)).to(draft.dtype)
    cos, sin = rope_cos_sin(positions, draft.inv_freq)
    eps = draft.cfg.rms_norm_eps
    for i, la in enumerate(draft.layers):
        a = la.self_attn
        h = rms_norm(x, la.input_layernorm.weight, eps)
        n, hd, kv, g = h.shape[0], a.cfg.head_dim, a.n_kv, a.n_heads // a.n_kv
        q = apply_rope(rms_norm(a.q_proj(h).view(n, a.n_heads, hd), a.q_norm.weight, eps), cos, sin, interleave=False)
        k = apply_rope(rms_norm(a.k_proj(h).view(n, kv, hd), a.k_norm.weight, eps), cos, sin, interleave=False)
        v = a.v_proj(h).view(n, kv, hd)
        q = q.view(r, b, kv, g, hd).permute(0, 2, 3, 1, 4).reshape(r, kv, g * b, hd)
        o = draft_attention(q, ctx.pool, i, ctx.table, k.view(r, b, kv, hd), v.view(r, b, kv, hd), ctx.mask)
        x = x + a.o_proj(o.view(r, kv, g, b, hd).permute(0, 3, 1, 2, 4).reshape(n, a.n_heads * hd))
        x = x + la.mlp(rms_norm(x, la.post_attention_layernorm.weight, eps))
    return rms_norm(x, draft.norm.weight, eps).view(r, b, -1)[:, 1:]


def check_draft_forward(root, num_kv_heads: int, dtype: torch.dtype, monkeypatch, device="cpu") -> None:
    """A draft's drafting forward (`propose`: the blocks' logits) on the modules' path against the
    same forward as separate ops (`ops_block_hidden`), unfused and then with its projections fused
    as the runner serves it. Unfused: bit for bit under the interpreter in fp32 only (it truncates
    to bf16 where a GPU rounds to nearest, so a residual add inside a norm and torch's own add
    differ there); on a GPU in bf16 only (fp32 differed on the H100 in the twenty-sixth session:
    an fp32 reduction or product need not round alike in two compiled forms), else close. Fused:
    close (the stacked product may accumulate in another order)."""
    from glm53.models import DFlashConfig, DFlashDraft, DraftBlock, GlmConfig, GlmForCausalLM, KVPools
    from glm53.models import add_draft_pools, load_draft_weights
    from glm53.models.draft_checkpoint import write_random_draft
    from glm53.models.fused import fuse_projections_
    from glm53.models.weights import load_weights
    from glm53.support.oracle import make_checkpoint

    make_checkpoint(root / "target", seed=5, index_topk_freq=2, index_skip_topk_offset=2)
    write_random_draft(root / "draft", root / "target", seed=3, dtype=torch.float32, n_layers=2, block_size=8,
                       num_heads=4, num_kv_heads=num_kv_heads, head_dim=16, intermediate_size=48)
    tcfg = GlmConfig.from_dir(root / "target")
    target = GlmForCausalLM(tcfg)
    load_weights(target, root / "target", progress=False)
    target.to(device=device, dtype=dtype)
    draft = DFlashDraft(DFlashConfig.from_dir(root / "draft", tcfg), tcfg, dtype=dtype)
    load_draft_weights(draft, root / "draft")
    draft.to(device)
    pools = KVPools(48, 4, device)
    add_draft_pools(pools, draft)
    pool = pools["draft_kv"].tensor
    pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(7)).to(pool.dtype).to(device))
    # two requests: scattered pages, one with its context starting past 0
    blocks = [DraftBlock(5, 9, [3, 7, 1, 9], 0, 8), DraftBlock(11, 5, [2, 4, 6], 2, 8)]

    def logits() -> torch.Tensor:
        return draft.propose(target, blocks, pools, return_logits=True)[1]

    def ops(self, *args, **kw):
        return ops_block_hidden(self, *args, **kw)

    got = logits()
    with monkeypatch.context() as m:
        m.setattr(DFlashDraft, "block_hidden", ops)
        want = logits()
    assert torch.isfinite(want).all()
    fuse_projections_(draft)
    assert all(la.self_attn.qkv is not None for la in draft.layers)
    fused = logits()
    # the context rows: the products summed and normed in one launch against the ops in turn,
    # with every feature here, and with the first one's product handed in as a stage's acc
    g = torch.Generator().manual_seed(11)
    caps = {i: torch.randn(9, tcfg.hidden_size, generator=g).to(dtype).to(device) for i in draft.cfg.target_layer_ids}
    first, *rest = draft.cfg.target_layer_ids
    upstream = draft.partial_projection({first: caps[first]})
    for c, c_ops in ((draft.context_of(caps), draft.context(draft.partial_projection(caps))),
                     (draft.context_of({i: caps[i] for i in rest}, upstream),
                      draft.context(draft.partial_projection({i: caps[i] for i in rest}, upstream)))):
        if dtype == torch.float32 or device != "cpu":
            assert torch.equal(c, c_ops)
        else:
            torch.testing.assert_close(c, c_ops, rtol=1e-2, atol=1e-2)
    if (dtype == torch.float32) == (device == "cpu"):
        assert torch.equal(got, want)
    tol = 1e-5 if dtype == torch.float32 else 0.05
    for out in (got, fused):
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)


def check_context_kv(n: int, nl: int, kv: int, hd: int, ps: int, dtype: torch.dtype, device="cpu") -> None:
    """`store_context_kv` into a pool of NaN: every written K equals RMSNorm (norm_triton, the
    draft layers' own) then RoPE (rope_triton) of its row bit for bit, every V its row; the ops'
    reference within rounding (its norm reduces as torch does); nothing else in the pool changes."""
    pages = -(-n // ps) + 3
    x = torch.randn(n, nl * 2 * kv * hd + 8, device=device).mul_(2).to(dtype)[:, : nl * 2 * kv * hd]
    x = x.view(n, nl, 2, kv, hd)  # strided rows, as a product's view may be
    w = torch.randn(nl, hd, device=device).to(dtype)
    positions = torch.randint(0, 100_000, (n,), device=device)
    slots = torch.randperm(pages * ps, device=device)[:n]
    inv = rope_inv_freq(hd, 1e6, device)
    pool = torch.full((pages, 2 * kv, nl, ps, hd), float("nan"), dtype=dtype, device=device)
    ref = pool.clone()
    store_context_kv(x, w, 1e-6, positions, slots, inv, pool)
    store_context_kv_reference(x, w, 1e-6, positions, slots, inv, ref)
    cos, sin = rope_cos_sin(positions, inv)
    page, off = slots // ps, slots % ps
    # the atol: a rotation's difference of near-equal products keeps its operands' rounding
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=8e-2)
    for layer in range(nl):
        k = apply_rope_triton(rms_norm_triton(x[:, layer, 0].contiguous(), w[layer], 1e-6), cos, sin, False)
        for h in range(kv):
            got = pool[page, 2 * h, layer, off]
            if device == "cpu":  # the interpreter's cos/sin are numpy's, not torch's
                torch.testing.assert_close(got, k[:, h], **tol)
            else:
                assert torch.equal(got, k[:, h]), (layer, h)
            assert torch.equal(pool[page, 2 * h + 1, layer, off], x[:, layer, 1, h])
    written = torch.zeros(pages, ps, dtype=torch.bool, device=device)
    written[page, off] = True
    assert pool.permute(0, 3, 1, 2, 4)[~written].isnan().all(), "a slot nobody wrote changed"
    got, want = pool.permute(0, 3, 1, 2, 4)[written], ref.permute(0, 3, 1, 2, 4)[written]
    torch.testing.assert_close(got.float(), want.float(), **tol)


def check_sum_rms_norm(P: int, N: int, D: int, with_acc: bool, dtype: torch.dtype, device="cpu") -> None:
    """`sum_rms_norm` (the draft context's products summed and normed in one launch) against the
    adds, the norm and the cast it replaces: under the interpreter fp32 out bit for bit and bf16
    out within one rounding (the interpreter truncates where a GPU rounds). On a GPU the two
    kernels' compiled sums of squares need not round alike (the H100 differed at D = 6144,
    twenty-sixth session): fp32 within a few ulps, bf16 within one rounding."""
    from glm53.kernels.norm import sum_rms_norm, sum_rms_norm_reference

    parts = (torch.randn(P, N, D + 8, device=device) * 3).to(dtype)[..., :D]  # strided rows
    acc = torch.randn(N, D, device=device) * 5 if with_acc else None
    w = torch.randn(D, device=device).to(dtype)
    for out in (torch.float32, torch.bfloat16):
        got = sum_rms_norm(parts, acc, w, 1e-6, out)
        s = acc
        for p in parts:  # the ops the draft ran: each product widened, added in order, normed, cast
            s = p.float() if s is None else s + p.float()
        want = rms_norm_triton(s, w, 1e-6).to(out)
        assert got.dtype == out and torch.isfinite(got).all()
        if out == torch.float32 and device == "cpu":
            assert torch.equal(got, want)
        elif out == torch.float32:
            torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-6)
        else:
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got.float(), sum_rms_norm_reference(parts, acc, w, 1e-6, out).float(),
                                   rtol=1e-2, atol=1e-2)
