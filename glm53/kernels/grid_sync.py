"""A one-launch grid barrier for decode-sized grids: every program counts in on a two-int32
counter buffer, polls until all have (at most a given number of polls), and counts out; the last
to count out sets both counters back to 0, so the buffer is zero between launches. Kernels that
share a buffer must never overlap (a module's own buffer, its launches queued on one stream).

A program that polled in vain (one not running beside it: the interpreter runs programs one by
one, a GPU too full to hold the whole grid) carries on without the others, so nothing can hang:
each caller computes what it waited for itself on that path."""

import triton
import triton.language as tl

from glm53.kernels.dispatch import triton_interpreting


def polls(limit: int) -> int:
    """A barrier's polls: none under the interpreter, which runs programs one by one."""
    return 0 if triton_interpreting() else limit


@triton.jit
def count_in_and_wait(sync_ptr, total, spin):
    """Counts this program in on sync_ptr[0] after every thread's stores (released with the count)
    and polls with acquire until `total` programs have, at most `spin` times: the programs in."""
    tl.debug_barrier()
    arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") + 1
    n = 0
    while (arrived < total) & (n < spin):
        arrived = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        n += 1
    return arrived


@triton.jit
def count_out(sync_ptr, total):
    """Counts this program out on sync_ptr[1]; the last of `total` zeroes both counters (no program
    polls then: each counted in before it counted out)."""
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == total - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
