"""The decode norms with each row in one program against the same norms spread over programs of
`norm_triton.SPLIT_COLUMNS` columns (`norm_triton.SPLIT_MAX_ROWS`), at GLM-5's widths and the
sums they take: the post-attention norm after o_proj's 4 fp32 split-K partials, a layer's first
norm after the MoE's 9 bf16 slot rows (quantizing, with the dense norm for the router), the final
norm (plain) after the same, and q_a's norm (2,048 wide, its product's 3 partials). Each timed in
a CUDA graph of 16 launches (µs a launch, median of 30 replays); the ratio is split / one program,
measured in the same run, and the split's outputs are checked against the one program's first.

    PYTHONPATH=. python3 benchmarks/split_norm.py [--rows 1 4 8]
"""

from __future__ import annotations

import argparse

import torch

from glm53.kernels import norm_triton
from glm53.kernels.fp8_act import rms_norm_fp8_triton
from glm53.kernels.norm_triton import rms_norm_triton
from glm53.kernels.row_parts import RowParts
from glm53.support.cuda_timing import graph_ms


def cases(m: int, dev: str):
    """(name, call(sync)) for m rows: fresh random inputs, never zeros."""
    bf, f32 = torch.bfloat16, torch.float32
    x = torch.randn(m, 6144, device=dev).to(bf)
    w = (torch.rand(6144, device=dev) + 0.5).to(bf)
    o_proj = RowParts(torch.randn(4, m, 6144, device=dev, dtype=f32), bf)
    slots = RowParts(torch.randn(9, m, 6144, device=dev).to(bf), bf)
    q_a = RowParts(torch.randn(3, m, 2048 + 576 + 128, device=dev, dtype=f32)[..., :2048], bf)
    w_a = (torch.rand(2048, device=dev) + 0.5).to(bf)
    return [
        ("post-attention (o_proj's 4 fp32 parts)", lambda s: rms_norm_fp8_triton(x, w, 1e-5, add=o_proj, sync=s)),
        ("first (the MoE's 9 slot rows, dense too)",
         lambda s: rms_norm_fp8_triton(x, w, 1e-5, dense=True, add=slots, sync=s)),
        ("final, plain (9 slot rows)", lambda s: rms_norm_triton(x, w, 1e-5, add=slots, sync=s)),
        ("q_a (2,048 wide, 3 fp32 parts)", lambda s: rms_norm_fp8_triton(q_a, w_a, 1e-6, sync=s)),
    ]


def outputs(out) -> list[torch.Tensor]:
    """A norm's outputs as fp32 tensors; quantized rows by their m real rows' codes (the padding
    rows are never written)."""
    out = out if isinstance(out, tuple) else (out,)
    return [t.rows()[0].float() if hasattr(t, "rows") else t.float() for t in out if t is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    a = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    sync = torch.zeros(2, dtype=torch.int32, device=dev)
    print(f"{torch.cuda.get_device_name()}; SPLIT_COLUMNS {norm_triton.SPLIT_COLUMNS}")
    print("| rows | norm | one program (µs) | split (µs) | split / one |")
    print("|---|---|---|---|---|")
    shipped = norm_triton.SPLIT_MAX_ROWS
    for m in a.rows:
        for name, call in cases(m, dev):
            norm_triton.SPLIT_MAX_ROWS = 0
            ref = outputs(call(sync))
            one = graph_ms([lambda: call(sync)] * 16) * 1e3
            norm_triton.SPLIT_MAX_ROWS = max(m, 1)
            got = outputs(call(sync))
            assert sync.tolist() == [0, 0], sync.tolist()
            worst = max(((g - r).abs() / r.abs().clamp_min(1e-3)).max().item() for g, r in zip(got, ref))
            split = graph_ms([lambda: call(sync)] * 16) * 1e3
            assert sync.tolist() == [0, 0], sync.tolist()
            print(f"| {m} | {name} | {one:.2f} | {split:.2f} | {split / one:.3f} | (max rel diff {worst:.1e})")
    norm_triton.SPLIT_MAX_ROWS = shipped


if __name__ == "__main__":
    main()
