"""Held-out prompts from an installed package's source (`support.corpus`): which files, which
tokens, and an error when the package has too few long files."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from glm53.server.embedded_model import ensure_embedded_model
from glm53.support.corpus import package_head_prompts, package_prompts


@pytest.fixture
def package(tmp_path, monkeypatch):
    root = tmp_path / "site" / "heldpkg"
    (root / "sub").mkdir(parents=True)
    texts = {
        "__init__.py": "x = 1\n",  # too short for any prompt
        "b.py": "".join(f"def f{i}(a, b):\n    return a * {i} + b\n" for i in range(40)),
        "sub/c.py": "".join(f"class C{i}:\n    value = '{i}' * 3\n" for i in range(60)),
        "a.py": "import os\n" * 3,  # short, and first by path
    }
    for rel, text in texts.items():
        (root / rel).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    tok = Tokenizer.from_file(str(ensure_embedded_model() / "tokenizer.json"))
    ids = {rel: tok.encode(text).ids for rel, text in texts.items()}
    return ids


def test_head_prompts_take_each_long_files_first_tokens(package):
    d = ensure_embedded_model()
    length = 30
    assert len(package["b.py"]) >= 2 * length and len(package["sub/c.py"]) >= 2 * length
    assert len(package["a.py"]) < length
    assert package_head_prompts(d, "heldpkg", 2, length) == [package["b.py"][:length], package["sub/c.py"][:length]]
    with pytest.raises(ValueError, match="fewer than 3 files"):
        package_head_prompts(d, "heldpkg", 3, length)


def test_middle_prompts_take_the_middle_of_files_twice_as_long(package):
    d = ensure_embedded_model()
    length = 30
    mid = lambda ids: ids[(len(ids) - length) // 2:][:length]  # noqa: E731
    assert package_prompts(d, "heldpkg", 2, length) == [mid(package["b.py"]), mid(package["sub/c.py"])]
    assert package_prompts(d, "heldpkg", 5, length, strict=False) == [mid(package["b.py"]), mid(package["sub/c.py"])]
    with pytest.raises(ValueError, match="not an installed package"):
        package_prompts(d, "no_such_package_here", 1, length)
