"""The Triton kernels themselves on CPU tensors, under the Triton interpreter.

Triton reads TRITON_INTERPRET at import, so this module only runs in a process started with
TRITON_INTERPRET=1: `test_interpreter.py` launches that process. In the main test process it
is skipped (with that reason)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs in its own TRITON_INTERPRET=1 process (tests/kernels/test_interpreter.py)", allow_module_level=True)

from glm53.kernels.dispatch import use_triton  # noqa: E402

from . import cases  # noqa: E402


def setup_module():
    assert use_triton(torch.empty(1)), "the dispatch rule must pick Triton for CPU tensors here"


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(abs(hash(request.node.name)) % (1 << 31))


# ---- top-k: set equality with the stable-sort reference ------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_random_ragged(dtype):
    # lengths: > k, == k, < k, 0, just above k, past L (clamped); L not a multiple of the block
    cases.check_topk(7, 9000, 256, [9000, 256, 100, 0, 257, 5000, 20000], dtype=dtype)


def test_topk_k_not_power_of_two_and_ties():
    cases.check_topk(4, 6000, 200, [6000, 5999, 1000, 199], kind="coarse")


def test_topk_heavy_ties_overflow_path():
    # three distinct values: the threshold bin overflows its candidate segments -> exact fallback
    cases.check_topk(3, 12000, 300, [12000, 9000, 4000], kind="ties")


@pytest.mark.parametrize("kind", ["randn", "ties", "special", "trend"])
def test_topk_fallback_path(kind):
    # a tiny candidate budget forces the streaming fallback on every row with length > k
    cases.check_topk(3, 7000, 256, [7000, 5000, 300], kind=kind, cand_total=16)


@pytest.mark.parametrize("kind", ["randn", "coarse", "trend"])
def test_topk_bracket_misses(kind):
    # a small sample and no margins: the bracket misses on some rows (either side)
    cases.check_topk(4, 9000, 256, [9000, 8000, 6000, 5000], kind=kind, sample=512, margin=0.0, margin_lo=0.0)
    # the upper edge forced below the k-th score: re-selection from the kept "above" scores
    cases.check_topk(4, 9000, 256, [9000, 8000, 6000, 4097], kind=kind, margin=-1.0, margin_lo=8.0)


@pytest.mark.parametrize("kind", ["trend", "falling"])
def test_topk_skewed_rows_overflow_tiles(kind):
    # the selected and candidate scores crowd into one chunk: per-chunk tiles overflow and the
    # segments are copied chunk by chunk (above) and compacted through the scratch (candidates)
    cases.check_topk(3, 9000, 256, [9000, 8500, 4100], kind=kind, cand_total=256, max_chunks=8, block=512)
    cases.check_topk(2, 9000, 256, [9000, 7000], kind=kind, paged=True, page_size=16, cand_total=256,
                     max_chunks=8, block=512)


def test_topk_special_values():
    cases.check_topk(3, 5000, 512, [5000, 3000, 600], kind="special")


def test_topk_paged():
    cases.check_topk(4, 7000, 256, [7000, 100, 0, 4097], paged=True, page_size=64)
    cases.check_topk(2, 3000, 128, [3000, 2999], kind="coarse", paged=True, page_size=16)


def test_topk_small_rows():
    # L < k: every row is trivial, -1 padded
    cases.check_topk(3, 100, 128, [100, 50, 0])


# ---- indexer logits ----------------------------------------------------------------------
def test_indexer_bf16_ragged_strided():
    # verify-like causal lengths (consecutive), ragged, zero
    cases.check_indexer_bf16(5, 8, 128, 700, [700, 699, 698, 31, 0], page_size=16)


def test_indexer_bf16_odd_heads():
    cases.check_indexer_bf16(2, 20, 64, 300, [300, 129], page_size=64)


@pytest.mark.parametrize("fp8_q", [False, True])
def test_indexer_fp8_overlap(fp8_q):
    # proportional to 2048 of 32K: 512 of 8192; mean overlap over rows (fewer selected -> more
    # spread per row, so the bar is 96% here and 97% at the GPU's 2048 of 32K)
    cases.check_indexer_fp8(4, 32, 128, 8192, 512, page_size=64, fp8_q=fp8_q, min_overlap=0.96)


# ---- sparse MLA ------------------------------------------------------------------------------
def test_sparse_mla_split():
    cases.check_sparse_mla(3, 16, 64, 16, 96, page_size=16)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sparse_mla_odd_heads(num_splits):
    cases.check_sparse_mla(3, 20, 32, 8, 50, page_size=8, num_splits=num_splits)


# schedule variants of the kernel (benchmarks/kernels.py --sweep times them on the GPU; the
# default is col_halves=True): each must give the reference's result, with -1 holes, short rows,
# an empty row, odd heads and splits
SPARSE_MLA_VARIANTS = [
    dict(col_halves=False, num_splits=1),
    dict(col_halves=False, num_splits=3),
    dict(col_halves=True, num_splits=1),
    dict(col_halves=True, num_splits=3, block_h=16),
    dict(col_halves=True, num_splits=2, block_n=32),
]


@pytest.mark.parametrize("kw", SPARSE_MLA_VARIANTS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_sparse_mla_variants(kw):
    cases.check_sparse_mla(3, 20, 32, 8, 50, page_size=8, **kw)  # odd heads, R=32: halves of 16
    cases.check_sparse_mla(3, 16, 48, 16, 70, page_size=4, **kw)  # R not a power of two
