"""What rounding the w8a8 products' activations to e4m3 costs greedy top-1, emulated on the CPU
(issue 29): the trained tiny target in the GLM-5-FP8 layout (`oracle.quantised_embedded_model`), 16
`transformers` source files (third-party code it never trained on; the same prompts as
`gpu_e2e.py`'s) teacher-forced over 192
prompt positions, then 64 decode steps fed the reference's greedy tokens; agreement with the
fp32 reference whose weights are dequantized and whose activations are exact.

Each FP8 product's input (the dense and attention products through `fp8_gemm_reference`, the
routed experts' x and h through the expert loop) is quantized per 1×128 group and dequantized
by the reference quantizer, in one term or two (`fp8_quant.quantize_residual_reference`), at the
decode steps only (prefill runs one term: what the GPU dispatch does, `fp8_act.two_terms`). The
GPU's figure comes from `gpu_e2e.py --fp8 --phases fp8`; this is the same measurement with
nothing but the activations' rounding in play.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/fp8_act_emulation.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from glm53.kernels import fp8_gemm, moe as moe_kernels
from glm53.kernels.fp8_quant import dequantize_fp8_groups, quantize_fp8_groups_reference, quantize_residual_reference
from glm53.models import ModelRunner, SeqChunk
from glm53.support.corpus import package_head_prompts
from glm53.support.oracle import quantised_embedded_model


class Rounding:
    """The activation rounding in force: `terms` (0 = exact, 1, 2) at decode steps, one term at
    prefill when `terms` > 0."""

    def __init__(self):
        self.terms, self.decode = 0, False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        terms = self.terms if self.decode else min(self.terms, 1)
        if terms == 0:
            return x
        x2 = x.reshape(-1, x.shape[-1]).float()
        q, s = quantize_fp8_groups_reference(x2)
        y = dequantize_fp8_groups(q, s)
        if terms == 2:
            y = y + dequantize_fp8_groups(*quantize_residual_reference(x2, q, s))
        return y.reshape(x.shape).to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--model", default="/tmp/tiny-glm5-fp8", help="where the FP8 tiny model is written (once)")
    a = ap.parse_args()
    rnd = Rounding()
    exact_gemm = fp8_gemm.fp8_gemm_reference
    fp8_gemm.fp8_gemm_reference = lambda x, w, s, out_dtype=None: exact_gemm(rnd(x), w, s, out_dtype)

    def swiglu(x, gate, up, down):  # the expert loop's product, its x and h rounded
        x = rnd(x)
        return rnd(F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()

    moe_kernels.swiglu_mlp = swiglu
    model_dir = quantised_embedded_model(Path(a.model))
    prompts = package_head_prompts(model_dir, "transformers", a.seqs, a.prompt_len)
    n, L = len(prompts), a.prompt_len
    per = -(-(L + a.steps + 1) // 64)
    pages = [list(range(i * per, (i + 1) * per)) for i in range(n)]

    def run(dtype: torch.dtype, follow):
        r = ModelRunner.from_dir(model_dir, page_size=64, num_pages=per * n, device="cpu", dtype=dtype, fp8=True,
                                 progress=False)
        rnd.decode = False
        out = r.forward([SeqChunk(p, 0, pg, all_logits=True) for p, pg in zip(prompts, pages)])
        rows, toks, fed = [torch.cat(out).float()], [o[-1].argmax(-1).item() for o in out], []
        rnd.decode = True
        for t in range(a.steps):
            feed = [f[t] for f in follow] if follow is not None else toks
            fed.append(feed)
            logits = r.forward([SeqChunk([feed[i]], L + t, pages[i]) for i in range(n)])
            rows.append(torch.cat(logits).float())
            toks = rows[-1].argmax(-1).tolist()
        return torch.cat(rows), [[fed[t][i] for t in range(a.steps)] for i in range(n)]

    ref, follow = run(torch.float32, None)
    print(f"{n} prompts x ({L} positions + {a.steps} decode steps) against the fp32 reference")
    print("| dtype | activations | prompt positions | decode steps |\n|---|---|---|---|")
    for name in a.dtypes.split(","):
        for terms, label in ((0, "exact"), (1, "one e4m3 term"), (2, "two terms at decode")):
            rnd.terms = terms
            rows, _ = run(getattr(torch, name), follow)
            same = rows.argmax(-1) == ref.argmax(-1)
            print(f"| {name} | {label} | {same[: n * L].float().mean():.2%} | {same[n * L:].float().mean():.2%} |",
                  flush=True)


if __name__ == "__main__":
    main()
