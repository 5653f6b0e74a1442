"""Runs SGLang's own `python -m sglang.bench_serving` on a CPU machine, against glm53-serve.

SGLang's package imports torchvision (image preprocessing of vision models) when bench_serving
loads; no torchvision wheel on these CPU machines loads with our torch, and bench_serving never
uses it, so `torchvision.*` resolves to empty stand-in modules here. Everything else is SGLang's
code as published. Set-up (sglang 0.5.23 without its dependencies, plus what bench_serving
imports), then the same arguments as bench_serving:

    pip install --no-deps --target /tmp/sglang sglang==0.5.23
    pip install --no-deps --target /tmp/sglang-deps orjson psutil pybase64 pillow msgspec ipython \
        traitlets aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist \
        datasets multiprocess pandas python-dateutil pytz tzdata pyarrow dill xxhash fsspec \
        apache-tvm-ffi sentencepiece compressed-tensors loguru gguf
    HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/sglang:/tmp/sglang-deps python benchmarks/sglang_client/run_bench_serving.py \
        --backend sglang --port 30000 --model glm-5-tiny --tokenizer <model dir> --dataset-name random-ids \
        --random-input-len 64 --random-output-len 16 --num-prompts 8 --return-logprob --top-logprobs-num 2
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import runpy
import sys
import types


class _Any(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any(name, (), {})


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any(name, (), {})


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StandIn(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0"
        return m

    def exec_module(self, module) -> None:
        pass


if __name__ == "__main__":
    sys.meta_path.insert(0, _TorchvisionStandIn())
    sys.argv[0] = "bench_serving"
    runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
