"""The CPU (torch reference) paths' cheaper forms against the formulas, on fresh random inputs:
MoE's experts (rows gathered and added back once for all experts), the indexer's logits (keys
gathered once per run of rows that share a page table: a verify block, a prefill chunk) and the
latent rows sparse MLA gathers (one index_select over a page-major layer view) and the DSA top-k
by selection (the reference's output exactly, ties included)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm53.kernels.indexer_logits import indexer_logits_reference, row_runs
from glm53.kernels.moe import moe_experts_reference
from glm53.kernels.sparse_mla import gather_slots
from glm53.kernels.topk import dsa_topk, dsa_topk_reference, dsa_topk_select


def test_moe_experts_match_the_per_token_sum():
    g = torch.Generator().manual_seed(11)
    E, I, H, k = 6, 24, 32, 2
    gate, up = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g)
    down = torch.randn(E, H, I, generator=g)
    for n in (1, 7, 20):
        x = torch.randn(n, H, generator=g)
        ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(n)])  # expert E-1 gets no row
        w = torch.rand(n, k, generator=g)
        want = torch.zeros(n, H, dtype=torch.float64)
        for t in range(n):
            for j in range(k):
                e = ids[t, j]
                h = F.silu(gate[e].double() @ x[t].double()) * (up[e].double() @ x[t].double())
                want[t] += w[t, j].double() * (down[e].double() @ h)
        torch.testing.assert_close(moe_experts_reference(x, w, ids, gate, up, down).double(), want,
                                   rtol=1e-4, atol=1e-4)
    empty = moe_experts_reference(torch.randn(0, H), torch.rand(0, k), torch.zeros(0, k, dtype=torch.long),
                                  gate, up, down)
    assert empty.shape == (0, H)


def test_indexer_logits_match_the_formula_for_shared_and_single_rows():
    g = torch.Generator().manual_seed(12)
    P, ps, D, H = 30, 4, 16, 3
    cache = torch.randn(P, ps, D, generator=g)
    a, b = [5, 2, 9, 14], [7, 21]
    # a verify block of request a, two single rows, a prefill chunk of request b, one more row of a
    rows = [(a, 11 + i) for i in range(5)] + [(b, 3), (a, 9)] + [(b, 1 + i) for i in range(6)] + [(a, 16)]
    pt = torch.full((len(rows), 5), -1, dtype=torch.int32)
    for i, (pg, _) in enumerate(rows):
        pt[i, : len(pg)] = torch.tensor(pg, dtype=torch.int32)
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    assert row_runs(pt) == [(0, 5), (5, 6), (6, 7), (7, 13), (13, 14)]
    q, w = torch.randn(len(rows), H, D, generator=g), torch.randn(len(rows), H, generator=g)
    max_len = int(lens.max())
    for sel in (slice(None), slice(5, 7), slice(0, 1)):  # mixed runs; single rows only; one row
        out = indexer_logits_reference(q[sel], w[sel], cache, pt[sel], lens[sel], max_len)
        for t, (pg, n) in list(enumerate(rows))[sel]:
            t0 = t - (sel.start or 0)
            keys = torch.stack([cache[pg[s // ps], s % ps] for s in range(n)]).double()
            want = (w[t].double()[:, None] * (q[t].double() @ keys.T).relu()).sum(0)
            torch.testing.assert_close(out[t0, :n].double(), want, rtol=1e-5, atol=1e-5)
            assert torch.isneginf(out[t0, n:]).all()


def test_gather_slots_matches_the_two_index_gather():
    g = torch.Generator().manual_seed(13)
    pool = torch.randn(9, 3, 4, 10, generator=g)  # page-major: [pages, layers, page_size, D]
    slots = torch.randint(0, 9 * 4, (5, 7), generator=g)
    for layer in range(3):
        view = pool[:, layer]
        assert torch.equal(gather_slots(view, slots), view[slots // 4, slots % 4])
    odd = pool[:, 0].transpose(1, 2)  # [9, 10, 4], rows not contiguous: the two-index gather
    slots = torch.randint(0, 9 * 10, (5, 7), generator=g)
    assert torch.equal(gather_slots(odd, slots), odd[slots // 10, slots % 10])


def test_topk_select_is_the_reference_exactly():
    """Same positions in the same order (score descending, a tie by the lower position), short
    rows padded with -1, -inf scores, k above the row length; and `dsa_topk` on a CPU takes the
    select for long rows with the same result."""
    g = torch.Generator().manual_seed(17)
    for trial in range(300):
        B, L, k = (int(torch.randint(1, n, (1,), generator=g)) for n in (20, 400, 100))
        x = torch.randint(-5, 5, (B, L), generator=g).float() if trial % 2 else torch.randn(B, L, generator=g)
        if trial % 5 == 0:
            x[0, :3] = float("-inf")
        lens = torch.randint(0, L + 1, (B,), generator=g).int()
        assert torch.equal(dsa_topk_select(x, lens, k), dsa_topk_reference(x, lens, k)), (trial, B, L, k)
    x = torch.randint(-40, 40, (3, 5000), generator=g).float()  # many ties
    lens = torch.tensor([5000, 4100, 30], dtype=torch.int32)
    assert torch.equal(dsa_topk(x, lens, 64), dsa_topk_reference(x, lens, 64))


def test_linear_f32_on_cpu_tensors_is_the_reference():
    """`linear_f32` on CPU tensors takes torch's product (the Triton kernel, for CUDA tensors, is
    tested under the interpreter): F.linear in fp32 on x widened, strided rows too, the scale
    applied only where it is not 1."""
    import pytest

    from glm53.kernels.dispatch import triton_interpreting
    from glm53.kernels.linear_f32 import TRITON_MAX_ROWS, linear_f32

    if triton_interpreting():
        pytest.skip("under TRITON_INTERPRET=1 CPU tensors run the kernel (test_interp_cases.py)")
    g = torch.Generator().manual_seed(19)
    w = torch.randn(16, 96, generator=g)
    for M, scale in ((1, 1.0), (5, 0.25), (TRITON_MAX_ROWS + 1, -3.0)):
        x = torch.randn(M, 104, generator=g).bfloat16()[:, 4:100]
        want = F.linear(x.float(), w)
        assert torch.equal(linear_f32(x, w, scale), want * scale if scale != 1.0 else want)

