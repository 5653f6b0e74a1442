"""Write a distillation corpus tree: this Python's standard library plus the installed third-party
packages' sources, minus the packages the held-out evaluations prompt with.

    python tools/build_corpus.py OUT [--exclude httpx transformers ...] [--max-mb-per-package 8]
    GLM53_CORPUS=OUT python tools/distill_draft.py ...

Why: the embedded target and its first drafts trained on the standard library only, and a draft
learns the target's continuations of the prompts it is shown; on third-party code (the held-out
checks: `httpx` on the CPU, `transformers` on the H200) τ fell by a third. A draft distilled on the
target's continuations of *other* third-party code sees that distribution without ever seeing the
evaluation packages (`--exclude`, default: every package any evaluation here prompts with).

OUT/stdlib/... and OUT/pkgs/<package>/...: `*.py` files only, each package capped at
`--max-mb-per-package` of source (files in sorted order) so one large package does not dominate.
glm53/support/corpus.py splits the tree by path (5 % held out) as it splits the standard library.
"""

from __future__ import annotations

import argparse
import shutil
import site
import sysconfig
from pathlib import Path

# Packages the held-out evaluations prompt with (tools/eval_dflash.py --package, the MTP table's
# τ): never in a training corpus.
EVAL_PACKAGES = ("httpx", "httpcore", "transformers", "starlette", "click", "uvicorn", "fastapi")


def copy_tree(src: Path, dst: Path, cap_bytes: int) -> tuple[int, int]:
    """Copy src's `*.py` files (sorted; caches and nested site-packages skipped, as corpus.py skips
    them) until cap_bytes; (files, bytes)."""
    n = size = 0
    for f in sorted(src.rglob("*.py")):
        rel = f.relative_to(src)
        if any(p in ("__pycache__", "site-packages", "dist-packages") for p in rel.parts):
            continue
        try:
            b = f.stat().st_size
        except OSError:
            continue
        if size + b > cap_bytes:
            break
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, out)
        n, size = n + 1, size + b
    return n, size


def build(out: Path, stdlib: Path, site_dirs: list[Path], exclude: list[str], cap_bytes: int,
          min_files: int) -> dict[str, int]:
    """Write the tree; {name: files copied} for the stdlib and each package taken."""
    if out.exists():
        raise SystemExit(f"{out} exists")
    taken = {}
    n, size = copy_tree(stdlib, out / "stdlib", 1 << 40)
    print(f"stdlib: {n} files, {size / 1e6:.1f} MB")
    taken["stdlib"] = n
    for sp in site_dirs:
        for pkg in sorted(sp.glob("*/__init__.py")) if sp.is_dir() else []:
            name = pkg.parent.name
            # by prefix: a renamed copy (e.g. an `httpx2` fork) is the same code
            if name in taken or name.startswith(("_", *exclude)):
                continue
            if sum(1 for _ in pkg.parent.rglob("*.py")) < min_files:
                continue
            n, size = copy_tree(pkg.parent, out / "pkgs" / name, cap_bytes)
            print(f"{name}: {n} files, {size / 1e6:.1f} MB")
            taken[name] = n
    print(f"excluded: {', '.join(exclude)}")
    return taken


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--exclude", nargs="*", default=list(EVAL_PACKAGES))
    ap.add_argument("--max-mb-per-package", type=float, default=8.0)
    ap.add_argument("--min-files", type=int, default=20, help="skip packages with fewer `*.py` files")
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--site", type=Path, nargs="*", help="package directories (default: this Python's site-packages)")
    a = ap.parse_args()
    sites = a.site if a.site is not None else [Path(p) for p in (*site.getsitepackages(), site.getusersitepackages())]
    build(a.out, a.stdlib, sites, a.exclude, int(a.max_mb_per_package * 1e6), a.min_files)


if __name__ == "__main__":
    main()
