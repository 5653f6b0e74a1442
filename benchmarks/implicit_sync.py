"""Which host-side CUDA calls make one stream's work wait for another's: with ~100 ms of work
queued on stream A, time an operation plus a tiny kernel on stream B. ~0 ms: independent; ~100 ms:
the call (or B's next kernel) waited for A. Matters where two loops share one GPU context
(engine/colocate.py): a decode step must not wait for a prefill chunk.

    python3 benchmarks/implicit_sync.py        (PYTORCH_CUDA_ALLOC_CONF changes the pinned path)
"""

from __future__ import annotations

import itertools
import os
import time

import torch


def probe(name: str, fn, a: torch.cuda.Stream, b: torch.cuda.Stream, x: torch.Tensor) -> float:
    torch.cuda.synchronize()
    with torch.cuda.stream(a):
        torch.cuda._sleep(200_000_000)  # ~100 ms on A
    t = time.perf_counter()
    with torch.cuda.stream(b):
        fn()
        (x + 1).sum()
        b.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    print(f"{name:55s} {ms:7.1f} ms", flush=True)
    return ms


def triton_kernel(x: torch.Tensor) -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(ptr + i, tl.load(ptr + i, mask=i < n) + 1, mask=i < n)

    global _add_one
    _add_one = globals().get("_add_one") or add_one
    _add_one[(triton.cdiv(x.numel(), 256),)](x, x.numel(), BLOCK=256)


def main() -> None:
    torch.cuda.init()
    a, b = torch.cuda.Stream(), torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    x = torch.zeros(1024, device="cuda")
    sizes = itertools.count(20)
    held = []  # keep what was allocated, so each probe misses the caches
    print(f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')} "
          f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '')}")
    probe("B's kernels launched for the first time", lambda: None, a, b, x)
    probe("nothing", lambda: None, a, b, x)
    probe("a torch kernel never launched before (cumsum on int16)",
          lambda: torch.ones(8, dtype=torch.int16, device="cuda").cumsum(0), a, b, x)
    probe("a Triton kernel compiled and launched for the first time", lambda: triton_kernel(x), a, b, x)
    probe("the same Triton kernel, another specialisation", lambda: triton_kernel(x[:17]), a, b, x)
    probe("the same Triton kernel again", lambda: triton_kernel(x[:17]), a, b, x)
    probe("pinned host tensor, a size not cached (cudaHostAlloc)",
          lambda: held.append(torch.empty(2 ** next(sizes), dtype=torch.uint8, pin_memory=True)), a, b, x)
    probe("pinned host tensor, the same size again (cached, freed)",
          lambda: torch.empty(64, dtype=torch.uint8, pin_memory=True), a, b, x)
    probe("non-blocking copy from a new pinned tensor",
          lambda: held.append(torch.tensor(list(range(1000 + next(sizes))), pin_memory=True).to("cuda", non_blocking=True)),
          a, b, x)
    probe("device tensor, new 1 GiB segment (cudaMalloc)",
          lambda: held.append(torch.empty(2 ** 30 + next(sizes) * 2 ** 21, dtype=torch.uint8, device="cuda")), a, b, x)
    probe("blocking copy of a pageable host list (torch.tensor(..., device=cuda))",
          lambda: torch.tensor([1, 2, 3], device="cuda"), a, b, x)
    probe("torch.cuda.Event record + query", lambda: torch.cuda.Event().record(), a, b, x)


if __name__ == "__main__":
    main()
