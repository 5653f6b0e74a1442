"""Reading a small device result back to the host without holding up other threads' CUDA calls.

Why: `tensor.tolist()` and `.cpu()` copy into pageable host memory, and the driver does that
copy synchronously, waiting inside the call for the stream to reach it. In a colocated pair
(engine/colocate.py) prefill's thread did so behind a chunk that runs ~100 ms on its SMs, and
decode's thread waited as long in its next event record (measured on an H200 with
benchmarks/cross_thread_sync.py: 99 ms; `item()` and `stream.synchronize()` did not hold it).
A pinned buffer, an asynchronous copy and an event the caller waits on (torch releases the GIL
there) leave the other threads' calls alone.
"""

from __future__ import annotations

import torch


def readback(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host, once the current stream has computed it. A CPU tensor is returned as is."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host
