"""`glm53.kernels` names its modules, nothing else: a function re-exported under a module's name
made `from glm53.kernels import indexer_logits as indexer_logits_mod` the function, and the
index-first attention (GPU only) failed reading the module's constant."""

import importlib
import os
import pkgutil

import glm53.kernels as kernels


def test_every_kernel_module_is_the_package_attribute():
    names = [m.name for m in pkgutil.iter_modules(kernels.__path__)]
    assert "indexer_logits" in names
    for name in names:
        mod = importlib.import_module(f"glm53.kernels.{name}")
        assert getattr(kernels, name) is mod, name


def test_fp_fusion_is_pinned_on_unless_the_user_set_it(monkeypatch):
    # the kernels' measured and bit-checked behaviour is with fusion on; Triton 3.10's default is off
    import triton

    for value, on in (("1", True), ("0", False)):
        monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", value)
        assert triton.knobs.language.fp_fusion_enabled(None) is on
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION")
    importlib.reload(kernels)
    assert os.environ["TRITON_DEFAULT_FP_FUSION"] == "1" and triton.knobs.language.fp_fusion_enabled(None)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    importlib.reload(kernels)  # a user's choice stands
    assert not triton.knobs.language.fp_fusion_enabled(None)
