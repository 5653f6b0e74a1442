"""Kernels launched early (programmatic dependent launch, CUDA, sm_90+): such a kernel's programs
start while the kernel before it runs, may read what does not depend on it (weights, a routing plan
written two kernels back), and wait (`gdc_wait`) before reading its output. A graph of many small
dependent kernels saves each one's launch latency that way (benchmarks/pdl_launch.py).

Two kinds here:
- the byte-heavy decode products (the FP8 GEMM's swapped tiles, the W_UV product, the MoE down
  kernel) prefetch their weight's first bytes into L2 before they wait (`prefetch_rows_l2`);
- the small kernels of a decode step (norms, sums, cache rows, routing, the attention's pieces)
  wait as they start and then let the kernel after them launch (`wait_then_release`), so at most
  two kernels of the chain are resident at once. `SMALL_KERNELS` switches them (`early_args`).

Correctness does not depend on the kernel before: one launched the usual way lets the next launch
as it ends, and a kernel launched the usual way after an early one waits for its whole grid, whose
programs each waited for the kernel before them (so every program of an early kernel waits)."""

import triton
import triton.language as tl

from glm53.kernels.dispatch import triton_interpreting

# The small kernels of a step launched early. On since timed: the chained-kernel benchmark saved
# 0.23-0.54 µs a boundary on the H200 (benchmarks/history/2026-12-04.md); in the FP8 slice's
# graphed decode step on an H100 (2026-12-06, benchmarks/early_launch.py) batch 1 took 1,027.3 µs
# against 1,039.2 off (with the W_UV and MoE down early launches too: 1,025.4), batch 64 the same.
SMALL_KERNELS = True


def pdl_option(pdl: bool) -> dict:
    """The launch keyword of a kernel launched early (none for the usual launch)."""
    return {"launch_pdl": True} if pdl else {}


def early_args() -> dict:
    """A small kernel's launch keywords: its `PDL` constexpr (`wait_then_release`) and, when
    `SMALL_KERNELS` is on in a compiled run, the launch option (griddepcontrol is inline PTX; the
    interpreter has none)."""
    pdl = SMALL_KERNELS and not triton_interpreting()
    return {"PDL": pdl, **pdl_option(pdl)}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """A small kernel's first statement: launched early (PDL), wait for the kernel before it (all
    of its writes visible), then let the kernel after it launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(row_ptrs, nbytes):
    """Bulk-prefetch `nbytes` (rounded down to 16) from each of the addresses `row_ptrs` (rounded
    down to 16, as the instruction needs: rows of a K that is no multiple of 16 start anywhere)
    into L2: one instruction a row, no registers held, nothing waits for it."""
    n16 = (nbytes // 16 * 16).to(tl.int32)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b64 a; setp.ne.u32 p, $2, 0; and.b64 a, $1, -16; "
        "@p cp.async.bulk.prefetch.L2.global [a], $2; mov.u32 $0, 0; }",
        "=r,l,r", [row_ptrs, tl.broadcast_to(n16, row_ptrs.shape)], dtype=tl.int32, is_pure=False, pack=1)
