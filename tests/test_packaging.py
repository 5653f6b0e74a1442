"""A plain (non-editable) install must carry every subpackage: setuptools drops folders that
`packages` in pyproject.toml does not list."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = py["tool"]["setuptools"]["package-dir"]
    listed = set(py["tool"]["setuptools"]["packages"])
    for pkg, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([pkg, *rel.parts]) if rel.parts else pkg
            assert name in listed, f"{name} ({init.parent}) is missing from [tool.setuptools] packages"


def test_plain_install_imports_every_subpackage(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(ROOT)],
        check=True, timeout=300, cwd=tmp_path,
    )
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mods = py["tool"]["setuptools"]["packages"]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    assert importlib.import_module(m).__file__.startswith(%r), m\n" % str(target)
    env = {**os.environ, "PYTHONPATH": str(target)}
    subprocess.run([sys.executable, "-c", code, *mods], check=True, timeout=120, cwd=tmp_path, env=env)
