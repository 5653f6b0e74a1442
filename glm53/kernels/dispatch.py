"""The one dispatch rule for every op in `glm53.kernels`.

CUDA tensors run the Triton kernel. CPU tensors run the torch reference, except in a process
started with TRITON_INTERPRET=1: Triton reads that variable at import, and then the public
functions run the Triton kernels on CPU tensors (how CI tests the kernels themselves).
Operands autograd tracks run the reference on any device: the Triton kernels have no backward,
and a kernel's output would silently cut the graph (training the MTP layer or a draft on a GPU).
Serving never meets this: model parameters never require grad and forwards run in inference mode.
"""

from __future__ import annotations

import functools
import os

import torch
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_interpreting() -> bool:
    return _INTERPRET


def use_triton(t: torch.Tensor, *operands: torch.Tensor) -> bool:
    """True when the op on tensor `t` (with its other tensor `operands`) should run its Triton kernel."""
    if torch.is_grad_enabled() and (t.requires_grad or any(o.requires_grad for o in operands)):
        return False
    return t.is_cuda or _INTERPRET


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX tiles), where a bf16 product
    of a few rows runs 2–3× faster than fp32's; without it bf16 is emulated and slower."""
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision for operands of `dtype`. float32 operands get IEEE products:
    tf32 perturbs index scores by ~1e-3, enough to flip near-tie top-k selections against the
    reference; 16- and 8-bit operands are exact in the tf32 path anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton dtype of a torch float dtype, for a kernel told its operands' type as a constexpr."""
    return _TL_DTYPES[dtype]


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA `device`; 0 for any other (no kernel sizes its grid to it there)."""
    if device.type != "cuda":
        return 0
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
