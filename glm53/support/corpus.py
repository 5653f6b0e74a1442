"""The corpus of the embedded pair: the running Python's standard library source (`*.py`,
recursively; `GLM53_CORPUS` names another tree), split by path: a file whose path relative to the
stdlib hashes (sha1) to < 5 % is held out. tools/train_tiny.py trains on it, tools/distill_draft.py
distils on its held-in part, and tools/eval_dflash.py and benchmarks/dflash_pd.py prompt with the
starts of held-out files (`held_file_prompts`).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import torch

HOLDOUT_PCT = 5


def stdlib_files(root: Path | None = None) -> list[tuple[str, str]]:
    """(path relative to the stdlib, text) of every `*.py` under `root` (default: this Python's
    standard library), sorted; site-packages excluded."""
    root = Path(root or os.environ.get("GLM53_CORPUS") or sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")):
            continue
        try:
            out.append((rel, f.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    return out


def held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100 < HOLDOUT_PCT


def corpus_streams(tdir) -> tuple[torch.Tensor, torch.Tensor]:
    """(held-in, held-out) token streams of the standard library (`held_out`'s split)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    files = stdlib_files()
    out = []
    for part in ([f for f in files if not held_out(f[0])], [f for f in files if held_out(f[0])]):
        ids: list[int] = []
        for enc in tok.encode_batch([t for _, t in part]):
            ids.extend(enc.ids)
            ids.append(eos)
        out.append(torch.tensor(ids, dtype=torch.long))
    return out[0], out[1]


def held_file_prompts(tdir, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `n` held-out files that have that many (in
    `stdlib_files` order): tools/eval_dflash.py's prompts."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    out = []
    for rel, text in stdlib_files():
        if held_out(rel):
            ids = tok.encode(text).ids
            if len(ids) >= length:
                out.append(ids[:length])
        if len(out) == n:
            break
    return out


def _package_token_files(tdir, package: str):
    """The token ids of each source file (sorted by path) of the installed `package`, by the
    tokenizer in `tdir`, one file at a time."""
    import importlib.util

    from tokenizers import Tokenizer

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{package!r} is not an installed package")
    tok = Tokenizer.from_file(str(Path(tdir) / "tokenizer.json"))
    for f in sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.py")):
        yield tok.encode(f.read_text(encoding="utf-8", errors="replace")).ids


def package_prompts(tdir, package: str, n: int, length: int, strict: bool = True) -> list[list[int]]:
    """`length` tokens from the middle of the first `n` source files (sorted by path) of the
    installed third-party `package` that have 2·`length` tokens: code neither the embedded
    target nor its drafts trained on (they trained on the standard library, site-packages
    excluded), for held-out speed and τ. Fewer files than `n`: an error if `strict`, else all."""
    out = []
    for ids in _package_token_files(tdir, package):
        if len(ids) >= 2 * length:
            mid = (len(ids) - length) // 2
            out.append(ids[mid: mid + length])
        if len(out) == n:
            return out
    if strict or not out:
        raise ValueError(f"{package}: fewer than {n} files of {2 * length} tokens")
    return out


def package_head_prompts(tdir, package: str, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `n` source files (sorted by path) of the installed
    `package` that have that many: the FP8 agreement checks' prompts (benchmarks/gpu_e2e.py,
    benchmarks/fp8_act_emulation.py). Fewer files than `n`: an error."""
    out = []
    for ids in _package_token_files(tdir, package):
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            return out
    raise ValueError(f"{package}: fewer than {n} files of {length} tokens")
