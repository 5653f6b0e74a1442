"""Write a random DFlash draft checkpoint (published layout) that fits a target checkpoint.

    .venv/bin/python tools/make_draft.py TARGET_DIR OUT_DIR [--layers 1] [--block-size 4] ...

The draft is deterministic for a seed and proposes random tokens: it exercises the speculative
path (shapes, KV transfer, verification) but will rarely be accepted.
"""

from __future__ import annotations

import argparse

import torch

from glm53.models.draft_checkpoint import write_random_draft

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=1, help="draft decoder layers")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default: the target's)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: as many as heads)")
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--intermediate-size", type=int, default=None)
    ap.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    ap.add_argument("--mask-token-id", type=int, default=None, help="default: the target's last vocabulary id")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    a = ap.parse_args(argv)
    out = write_random_draft(
        a.out_dir, a.target_dir, seed=a.seed, dtype=DTYPES[a.dtype], n_layers=a.layers, block_size=a.block_size,
        num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim, intermediate_size=a.intermediate_size,
        target_layer_ids=a.target_layer_ids, mask_token_id=a.mask_token_id,
    )
    print(out)


if __name__ == "__main__":
    main()
