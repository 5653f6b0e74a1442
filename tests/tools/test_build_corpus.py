"""tools/build_corpus.py: the stdlib and third-party sources, never a package an evaluation
prompts with (nor a renamed copy of one), each package capped."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("build_corpus", ROOT / "tools" / "build_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _package(root: Path, name: str, files: int, size: int = 10) -> None:
    for i in range(files):
        f = root / name / f"m{i:02d}.py"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x" * size)
    (root / name / "__init__.py").write_text("")
    (root / name / "__pycache__").mkdir()
    (root / name / "__pycache__" / "m.py").write_text("cached")


def test_evaluated_packages_and_their_copies_are_left_out(tmp_path, tool):
    stdlib, site = tmp_path / "lib", tmp_path / "site"
    _package(stdlib, "json", 3)
    for name in ("numpy", "httpx", "httpx2", "transformers", "tiny", "_private", "big"):
        _package(site, name, 2 if name == "tiny" else 25, size=100 if name == "big" else 10)
    taken = tool.build(tmp_path / "out", stdlib, [site], list(tool.EVAL_PACKAGES), cap_bytes=1000, min_files=20)
    assert set(taken) == {"stdlib", "numpy", "big"}
    assert taken["stdlib"] == 4 and taken["numpy"] == 26
    assert taken["big"] == 11  # the empty __init__ and ten 100-byte files fill the 1000-byte cap
    out = tmp_path / "out"
    assert not list(out.rglob("__pycache__")) and not (out / "pkgs" / "httpx2").exists()
    assert all(held in tool.EVAL_PACKAGES for held in ("httpx", "transformers", "click", "starlette"))
    with pytest.raises(SystemExit, match="exists"):
        tool.build(out, stdlib, [site], [], cap_bytes=1000, min_files=1)
