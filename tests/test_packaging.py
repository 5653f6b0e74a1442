"""The checkout is the package: `glm53/` imports from the tree itself, and a plain (non-editable)
install carries every subpackage (setuptools' `packages.find` drops folders without `__init__.py`)."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _subpackages() -> list[str]:
    return sorted(".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "glm53").rglob("__init__.py"))


def test_every_source_folder_is_a_package():
    for py in (ROOT / "glm53").rglob("*.py"):
        assert (py.parent / "__init__.py").exists(), f"{py.parent} holds Python files but no __init__.py"


def test_checkout_imports_without_install(tmp_path):
    # `python -S` skips site-packages' .pth files, so the editable install's finder is not there:
    # glm53 can only come from the tree (PYTHONPATH=.), its dependencies from site-packages.
    code = (f"import sys; sys.path += [{sysconfig.get_paths()['purelib']!r}]\n"
            "import glm53.server.cli, glm53.models.model, glm53.transport.engine, glm53.kernels.dispatch\n"
            "print(glm53.server.cli.__file__)")
    env = {**os.environ, "PYTHONPATH": "."}
    out = subprocess.run([sys.executable, "-S", "-c", code], check=True, timeout=120, cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert Path(out.stdout.strip()).resolve() == ROOT / "glm53" / "server" / "cli.py"


def test_plain_install_imports_every_subpackage(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(ROOT)],
        check=True, timeout=300, cwd=tmp_path,
    )
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    assert importlib.import_module(m).__file__.startswith(%r), m\n" % str(target)
    env = {**os.environ, "PYTHONPATH": str(target)}
    subprocess.run([sys.executable, "-c", code, *_subpackages()], check=True, timeout=120, cwd=tmp_path, env=env)
