"""Build the Gluon sparse-MLA kernels for sm_90 without a GPU: shared memory, registers, spills.

    PYTHONPATH=.:TRITON36 python tools/gluon_build.py [--kernel fp8|bf16] [--block-n 64] [--heads 64] \
        [--stages 0] [--no-split] [--producers 1] [--sass OUT.sass]

Why: Gluon has no interpreter and the GPU is scarce; `triton.compile` with an explicit target
runs the whole pipeline here (Gluon -> PTX -> ptxas), so a build error, the shared-memory total and
the ptxas spill count (`ptxas -v`) show up before a device run. The Triton must be the GPU
image's (3.6 when written: its Gluon still has `async_copy_global_to_shared`, which newer Tritons
removed), e.g. `pip install --no-deps --target TRITON36 triton==3.6.0` and TRITON36 first on
PYTHONPATH. The kernel's integer arguments are built as the launcher's would specialize them at
GLM-5 shapes (pointers and strides divisible by 16).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

DIV16 = ("q_ptr", "kv_ptr", "c8_ptr", "sc_ptr", "rp_ptr", "idx_ptr", "out_ptr", "part_ptr", "lse_ptr", "split_len",
         "stride_qt", "stride_qh", "stride_kp", "stride_ks", "stride_p", "stride_s", "stride_it", "stride_ot",
         "stride_oh")
TYPES = dict(q_ptr="*bf16", kv_ptr="*bf16", c8_ptr="*fp8e4nv", sc_ptr="*fp32", rp_ptr="*bf16", idx_ptr="*i32",
             out_ptr="*bf16", K="i32", qk_scale="fp32", split_len="i32")


def build(kernel: str, block_n: int, heads: int, stages: int, split: bool, producers: int = 1):
    if kernel == "fp8":
        from glm53.kernels import sparse_mla_fp8_hopper as m

        fn, maxnreg = m._sparse_mla_fp8_hopper_kernel, m.MAXNREG
        const = dict(STAGES=stages, PWARPS=4 // producers, NPROD=producers)
    else:
        from glm53.kernels import sparse_mla_hopper as m

        fn, maxnreg = m._sparse_mla_hopper_kernel, m.MAXNREG
        const = {}
    const.update(H=heads, R=512, P=64, PAGE=64, BH=64, BN=block_n, NHB=-(-heads // 64), SPLIT=split, num_warps=4)
    part = "*fp32" if split else "*bf16"
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in ("part_ptr", "lse_ptr"):
            sig[name] = part
        else:
            sig[name] = TYPES.get(name, "i32")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in DIV16 if n in fn.arg_names}
    t0 = time.time()
    k = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, maxnreg=maxnreg))
    return k, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--stages", type=int, default=0)
    ap.add_argument("--no-split", action="store_true")
    ap.add_argument("--producers", type=int, default=1, help="fp8: partitions of the 4 producer warps (1 or 2)")
    ap.add_argument("--sass", help="write the SASS here")
    a = ap.parse_args()
    k, secs = build(a.kernel, a.block_n, a.heads, a.stages, not a.no_split, a.producers)
    print(f"triton {triton.__version__}: built in {secs:.1f} s, shared memory {k.metadata.shared} B")
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        r = subprocess.run([os.path.join(bindir, "ptxas"), "-v", "-arch=sm_90a", ptx, "-o", cubin],
                           capture_output=True, text=True)
        print("\n".join(line for line in (r.stdout + r.stderr).splitlines() if "spill" in line or "registers" in line))
    if a.sass:
        with open(a.sass, "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-sass", a.sass], capture_output=True,
                              text=True).stdout
        with open(a.sass, "w") as f:
            f.write(sass)


if __name__ == "__main__":
    main()
