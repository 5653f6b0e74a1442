"""The FP8 slice's decode step with module constants set otherwise: an in-step A/B of kernel rules
that are switched by one constant each (`moe_fp8_triton.SPLIT_WAVES`, `moe_fp8_triton.DOWN_PREFETCH`,
`fp8_gemm_triton.DEEP_ONE_ROW`, ...). The first setting is the code as shipped; each `--set` names a
setting and the constants it changes, all other constants back at their shipped values. Timed by
`early_launch.step_ab` (the step's graph replayed back to back, the settings interleaved over
`--rounds`); the logits' relative difference to the shipped step is printed (a rule may sum in
another order). `--json` writes the report with each setting's assignments; `--trace` lists the
named settings' kernels at the first size, with the gaps between them.

    PYTHONPATH=. python3 benchmarks/step_knobs.py [--sizes 1 64] [--rounds 2] [--json out.json] [--trace shipped,waves]
        --set "waves:glm53.kernels.moe_fp8_triton.SPLIT_WAVES=2.0"
        --set "both:glm53.kernels.moe_fp8_triton.SPLIT_WAVES=2.0;glm53.kernels.fp8_gemm_triton.DEEP_ONE_ROW=False"
    (a GPU of compute capability 9.0+)
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
from dataclasses import dataclass
from functools import partial
from typing import Any

from benchmarks import early_launch


@dataclass(frozen=True)
class Knob:
    module: str
    attr: str
    value: Any


def parse_setting(text: str) -> tuple[str, list[Knob]]:
    """`NAME:pkg.module.ATTR=VALUE[;...]` -> (NAME, knobs). VALUE is a Python literal; the module
    must already have ATTR (a misspelt constant would otherwise time the shipped step twice)."""
    name, sep, body = text.partition(":")
    if not sep or not name or name == "shipped":
        raise ValueError(f"--set {text!r}: expected NAME:module.ATTR=VALUE[;...] with a NAME other than 'shipped'")
    knobs = []
    for part in filter(None, (p.strip() for p in body.split(";"))):
        target, eq, value = part.partition("=")
        module, dot, attr = target.strip().rpartition(".")
        if not (eq and dot):
            raise ValueError(f"--set {text!r}: {part!r} is not module.ATTR=VALUE")
        mod = importlib.import_module(module)
        if not hasattr(mod, attr):
            raise ValueError(f"--set {text!r}: {module} has no {attr}")
        knobs.append(Knob(module, attr, ast.literal_eval(value.strip())))
    if not knobs:
        raise ValueError(f"--set {text!r}: no constants given")
    return name, knobs


def apply(knobs: list[Knob], shipped: dict[tuple[str, str], Any]) -> None:
    """Every constant any setting touches back at its shipped value, then these knobs set."""
    for (module, attr), value in shipped.items():
        setattr(importlib.import_module(module), attr, value)
    for k in knobs:
        setattr(importlib.import_module(k.module), k.attr, k.value)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    early_launch.step_args(ap, [1, 64])
    ap.add_argument("--set", dest="settings", action="append", default=[], help="NAME:module.ATTR=VALUE[;...]")
    ap.add_argument("--trace", default="", help="settings (comma-separated) whose first size's step kernels to list")
    a = ap.parse_args()
    settings = dict(parse_setting(s) for s in a.settings)
    if len(settings) != len(a.settings):
        ap.error("--set names must differ")
    traced = [t for t in a.trace.split(",") if t]
    if unknown := set(traced) - {"shipped", *settings}:
        ap.error(f"--trace: no setting named {sorted(unknown)}")
    touched = {(k.module, k.attr) for knobs in settings.values() for k in knobs}
    shipped = {key: getattr(importlib.import_module(key[0]), key[1]) for key in touched}
    print(torch.cuda.get_device_name(), flush=True)
    early_launch.switch("shipped")
    runs = {"shipped": partial(apply, [], shipped)} | {n: partial(apply, k, shipped) for n, k in settings.items()}
    try:
        report = early_launch.step_ab(early_launch.slice_runner(a.slice), a.sizes, a.rounds, a.context, runs,
                                      traced=traced)
    finally:
        apply([], shipped)
    if a.json:
        knobs = {n: [f"{k.module}.{k.attr}={k.value!r}" for k in ks] for n, ks in settings.items()}
        a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "context": a.context,
                                      "settings": knobs, "results": report}, indent=1))


if __name__ == "__main__":
    main()
