"""Build Triton kernels for sm_90 without a GPU, as their launchers launch them: registers, spills.

    PYTHONPATH=.[:TRITON36] python tools/triton_build.py [--only topk,fp8_gemm,moe_fp8] [--sms 132]

Why: the interpreter runs a kernel's arithmetic, not its compilation (a loop-carried value whose
type changes, a layout the lowering rejects, a register file overrun), and the GPU is scarce.
Each case below runs the real launchers on CPU tensors at GLM-5's shapes, with every kernel's
`run` replaced by a recorder and the SM count a GPU's (so the launchers pick the tiles, splits
and warps they pick on the H200); each recorded launch is compiled by `triton.compile` for the
target (TTIR -> PTX -> cubin) with Triton's own specialization of its arguments (ints equal to 1
or divisible by 16, 16-byte-aligned pointers), and the cubin's resource usage (`cuobjdump
-res-usage`) gives registers and local memory (spills).
With the GPU image's Triton first on PYTHONPATH (`pip install --no-deps --target DIR
triton==3.6.0`) it builds what the device builds. `tools/gluon_build.py` does the same for the
Gluon kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1",
          torch.float8_e4m3fn: "fp8e4nv"}


@dataclass
class Launch:
    kernel: object  # the JITFunction
    args: dict  # argument name -> value, as launched
    options: dict  # num_warps, num_stages, maxnreg, ...


@dataclass
class Built:
    name: str
    constexprs: dict
    options: dict
    registers: int
    local_bytes: int  # stack + local memory a thread: spills (0 when everything fits registers)
    shared: int
    seconds: float


def glm53_kernels() -> list:
    """Every Triton kernel (JITFunction) of the glm53.kernels modules."""
    import importlib
    import pkgutil

    import glm53.kernels as pkg
    from triton.runtime.jit import JITFunction

    out = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"glm53.kernels.{info.name}")
        out += [v for k, v in vars(mod).items() if isinstance(v, JITFunction) and v.__module__ == mod.__name__
                and v.fn.__name__.endswith("_kernel")]
    return out


@contextlib.contextmanager
def recording(sms: int) -> Iterator[list[Launch]]:
    """Record the launches of every glm53 Triton kernel instead of running them (a launcher's
    later kernels then read unwritten buffers: only the launches matter here); every launcher's
    SM count reads `sms`, so it sizes grids, splits and tiles as on a GPU."""
    from glm53.kernels import dispatch, fp8_gemm_triton, moe_fp8_triton, topk_triton

    log: list[Launch] = []
    kernels = glm53_kernels()
    saved = [(fn, fn.run) for fn in kernels]
    patched = [(m, name, getattr(m, name)) for m, name in ((dispatch, "sm_count"), (fp8_gemm_triton, "sm_count"),
                                                          (moe_fp8_triton, "sm_count"), (topk_triton, "_num_sms"))]
    for fn in kernels:
        def run(*args, grid, warmup, _fn=fn, **kwargs):
            names = [p.name for p in _fn.params]
            bound = dict(zip(names, args))
            bound.update({k: v for k, v in kwargs.items() if k in names})
            log.append(Launch(_fn, bound, {k: v for k, v in kwargs.items() if k not in names}))
        fn.run = run
    for m, name, _ in patched:
        setattr(m, name, lambda device, _s=sms: _s)
    try:
        yield log
    finally:
        for fn, run in saved:
            fn.run = run
        for m, name, old in patched:
            setattr(m, name, old)


def source(launch: Launch) -> tuple[ASTSource, dict]:
    """The ASTSource Triton would compile for this launch, and its compile options."""
    fn = launch.kernel
    sig, const, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        x = launch.args[p.name]
        if p.is_constexpr or x is None:
            sig[p.name], const[p.name] = "constexpr", x
        elif isinstance(x, bool):
            sig[p.name] = "i1"
        elif isinstance(x, int):
            if x == 1 and not p.do_not_specialize:
                sig[p.name], const[p.name] = "constexpr", 1
                continue
            sig[p.name] = "i32" if -(2**31) <= x < 2**31 else "i64"
            if x % 16 == 0 and not p.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(x, float):
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "*" + DTYPES[x.dtype]
            if x.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, sig, const, attrs), dict(launch.options)


def build(launch: Launch, arch: int = 90) -> Built:
    """Compile the launch for sm_`arch` and read the cubin's resource usage (`cuobjdump`)."""
    src, options = source(launch)
    t0 = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    secs = time.time() - t0
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    res = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    const = {n: v for n, v in launch.args.items() if src.signature.get(n) == "constexpr"}
    return Built(launch.kernel.fn.__name__, const, options, int(res["REG"]), int(res["STACK"]) + int(res["LOCAL"]),
                 k.metadata.shared, secs)


# ---- cases: the launchers at GLM-5's shapes (tp = 8 for the products), on CPU tensors ----------


def case_topk():
    from glm53.kernels import topk_triton as tt

    def run():
        for B, L in ((1, 4096), (64, 8192), (1, 2048), (8, 65536)):
            x = torch.randn(B, L)
            lens = torch.full((B,), L, dtype=torch.int32)
            pt = torch.zeros(B, -(-L // 64) + 16, dtype=torch.int32)[:, : -(-L // 64)]
            tt.topk_triton(x, lens, 2048, page_table=pt, page_size=64, pdl=True)

    return run


def case_fp8_gemm():
    from glm53.kernels import fp8_gemm_triton as g
    from glm53.kernels.fp8_quant import quantize_fp8_blocks

    def run():
        w, ws = quantize_fp8_blocks(torch.randn(2048, 768))  # q_b at tp = 8: [2048, 768]
        for M in (1, 16, 64, 4096):
            g.fp8_gemm_w8a8(torch.randn(M, 768, dtype=torch.bfloat16), w, ws, lo=M <= 16)
        g.fp8_gemm_w8a16(torch.randn(1, 768, dtype=torch.bfloat16), w, ws)

    return run


def case_moe_fp8():
    from glm53.kernels import moe_fp8_triton as m
    from glm53.kernels.fp8_quant import quantize_fp8_blocks

    def run():
        # GLM-5's tp = 8 expert widths (hidden 6144, 256 columns an expert), fewer experts; the
        # gate and up halves fused, as the loader stacks them
        E, H, inter, topk = 9, 6144, 256, 8
        gate, gs = quantize_fp8_blocks(torch.randn(E, 2 * inter, H))
        down, ds = quantize_fp8_blocks(torch.randn(E, H, inter))
        for N in (1, 4, 64):
            x = torch.randn(N, H, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(E)[:topk] for _ in range(N)]).int()
            for variant in ("w8a8", "w8a16"):
                m.moe_experts_fp8_triton(x, torch.rand(N, topk), ids, gate, gs, None, None, down, ds, variant=variant)

    return run


CASES = {"topk": case_topk, "fp8_gemm": case_fp8_gemm, "moe_fp8": case_moe_fp8}


def launches(name: str, sms: int = 132) -> list[Launch]:
    """The distinct launches (by kernel, constexprs and options) a case makes."""
    with recording(sms) as log:
        CASES[name]()()
    seen, out = set(), []
    for la in log:
        src, opts = source(la)
        key = (la.kernel.fn.__name__, tuple(sorted(src.signature.items())), tuple(sorted(map(str, src.constants.items()))),
               tuple(sorted(opts.items())))
        if key not in seen:
            seen.add(key)
            out.append(la)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args()
    print(f"triton {triton.__version__}, sm_{a.arch}", flush=True)
    for name in a.only.split(","):
        for la in launches(name, a.sms):
            b = build(la, a.arch)
            short = {k: v for k, v in b.constexprs.items() if not isinstance(v, torch.dtype)}
            print(f"{name}: {b.name} {short} {b.options}: {b.registers} registers, {b.local_bytes} B local, "
                  f"{b.shared} B shared, {b.seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
