"""Load a Hugging Face GLM-5 checkpoint (`model.safetensors.index.json` + shards, or a single
`model.safetensors`) into `GlmForCausalLM`.

Missing or unexpected tensors are errors that name them. Indexer weights must exist exactly on
the schedule's "full" layers. MTP layers (ids ≥ num_hidden_layers) are skipped with one log line.
Block-FP8 checkpoints (`weight_scale_inv`) are dequantised to the model dtype at load.

The loader is generic over tensor parallelism: each parameter's shard rule (`sharding.Shard`)
says which part of its checkpoint tensor this rank holds, and only that part is read
(`safe_open(...).get_slice(name)[...]`), with the matching blocks of `weight_scale_inv` for FP8;
replicated tensors are read whole.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from glm53.models.config import GlmConfig
from glm53.models.model import GlmForCausalLM
from glm53.models.sharding import shard_of

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Routed experts: stacked [E, ...] in the model as `<layer>.mlp.experts.<proj>`, stored per
# expert in the checkpoint as `<layer>.mlp.experts.<e>.<proj>.weight`.
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # per-expert checkpoint order
_SCALE_SUFFIX = "_scale_inv"


class WeightError(ValueError):
    """The checkpoint does not match the model config; the message names the tensors/layers."""


def _names(items: list[str], limit: int = 8) -> str:
    items = sorted(items)
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name → file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise WeightError(f"{model_dir}: neither model.safetensors.index.json nor model.safetensors found")


def check_indexer_schedule(cfg: GlmConfig, names: list[str]) -> None:
    """Indexer weights must exist exactly on the full layers (docs/ARCHITECTURE.md, "Indexer schedule")."""
    have = set()
    for n in names:
        m = _LAYER.match(n)
        if m and ".self_attn.indexer." in n and int(m.group(1)) < cfg.num_hidden_layers:
            have.add(int(m.group(1)))
    want = set(cfg.full_layers)
    if have != want:
        extra, missing = sorted(have - want), sorted(want - have)
        parts = []
        if missing:
            parts.append(f"layers {missing} are 'full' in the indexer schedule but have no indexer weights")
        if extra:
            parts.append(f"layers {extra} are 'shared' in the indexer schedule but carry indexer weights")
        raise WeightError("checkpoint disagrees with the indexer schedule: " + "; ".join(parts))


def checkpoint_tensors(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor a checkpoint holds for `model` (one stage or all): checkpoint name ->
    (full checkpoint shape, also on a tensor-parallel shard; dtype as the model holds it), in
    parameter order. The inverse of the loader's mapping:
    a stacked routed-expert parameter [E, ...] becomes E per-expert tensors, listed expert-major
    (expert e's gate, up, down before expert e + 1's), as Hugging Face checkpoints list them.
    Works on a model built on the meta device."""
    params = dict(model.named_parameters())
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    done: set[str] = set()
    for name, p in params.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = (shard_of(p).full_shape(p.shape), p.dtype)
        elif m.group(1) not in done:  # the layer's first stacked tensor lists all its experts
            done.add(m.group(1))
            stacks = [(proj, params[f"{m.group(1)}.{proj}"]) for proj in _EXPERT_PROJS]
            for e in range(p.shape[0]):
                for proj, q in stacks:
                    out[f"{m.group(1)}.{e}.{proj}.weight"] = (shard_of(q).full_shape(q.shape[1:]), q.dtype)
    return out


class CheckpointReader:
    """Reads checkpoint tensors, whole or one part, opening each file once (inside `stack`).
    Block-FP8 weights come back dequantised to fp32."""

    def __init__(self, files: dict[str, Path], cfg: GlmConfig, stack: ExitStack):
        self.files, self.cfg, self.stack = files, cfg, stack
        self._handles: dict[Path, object] = {}

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self.stack.enter_context(safe_open(str(path), framework="pt"))
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        """The tensor `name`, or only its part `index` (explicit start/stop on every dimension)."""
        h = self._handle(name)
        t = h.get_tensor(name) if index is None else h.get_slice(name)[index]
        scale_name = name + _SCALE_SUFFIX
        if self.cfg.quant_method == "fp8" and scale_name in self.files:
            if index is None:
                index = tuple(slice(0, d) for d in self.shape(name))
            t = self._dequant_fp8(name, t, scale_name, index)
        return t

    def _dequant_fp8(self, name: str, w: torch.Tensor, scale_name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Dequantises the part `index` of a block-FP8 weight with the scale blocks covering it
        (a part may start mid-block: the expanded scales are cropped by the offset)."""
        if w.dim() != 2:
            raise WeightError(f"{name}: block-FP8 scales need a 2-D weight, got shape {tuple(w.shape)}")
        (r0, r1), (c0, c1) = ((s.start, s.stop) for s in index)
        br, bc = self.cfg.weight_block_size
        scales = self._handle(scale_name).get_slice(scale_name)[r0 // br : -(-r1 // br), c0 // bc : -(-c1 // bc)]
        s = scales.float().repeat_interleave(br, 0)[r0 % br : r0 % br + (r1 - r0)]
        s = s.repeat_interleave(bc, 1)[:, c0 % bc : c0 % bc + (c1 - c0)]
        return w.float() * s


def load_weights(model: GlmForCausalLM, model_dir: str | Path, progress: bool = True) -> None:
    cfg = model.cfg
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    check_indexer_schedule(cfg, list(files))

    params = dict(model.named_parameters())
    expected = set(checkpoint_tensors(model))
    if cfg.tie_word_embeddings and "lm_head.weight" in expected and "lm_head.weight" not in files:
        expected.discard("lm_head.weight")
        tie = True
    else:
        tie = False

    stage_layers = set(model.layer_range)
    mtp_layers: set[int] = set()
    loaded: set[str] = set()
    unexpected: list[str] = []
    todo = []
    for name in files:
        if name.endswith(_SCALE_SUFFIX) and cfg.quant_method == "fp8":
            continue
        m = _LAYER.match(name)
        if m:
            layer = int(m.group(1))
            if layer >= cfg.num_hidden_layers:
                mtp_layers.add(layer)
                continue
            if layer not in stage_layers:
                continue  # another pipeline stage's layer
        elif name not in expected and (name.startswith("model.embed_tokens") or name.startswith(("model.norm", "lm_head"))):
            continue  # first/last-stage tensors on a middle stage
        if name in expected:
            todo.append(name)
        else:
            unexpected.append(name)
    if unexpected:
        raise WeightError(f"{model_dir}: unexpected tensors in the checkpoint: {_names(unexpected)}")
    missing = expected - set(todo)
    if missing:
        raise WeightError(f"{model_dir}: tensors missing from the checkpoint: {_names(list(missing))}")
    if mtp_layers:
        log.info("skipping MTP layer(s) %s (num_nextn_predict_layers=%d)", sorted(mtp_layers), cfg.num_nextn_predict_layers)

    with ExitStack() as stack, torch.no_grad():
        reader = CheckpointReader(files, cfg, stack)
        bar = tqdm(todo, desc="loading weights", unit="tensor", file=sys.stderr, disable=not progress, leave=False)
        for name in bar:
            m = _EXPERT.match(name)
            if m:
                p = params[f"{m.group(1)}.{m.group(3)}"]
                dst = p[int(m.group(2))]
            else:
                p = dst = params[name]
            rule = shard_of(p)
            have, want = reader.shape(name), rule.full_shape(dst.shape)
            if have != want:
                raise WeightError(f"{name}: shape {have} in the checkpoint, model expects {want}")
            dst.copy_(reader.read(name, rule.index(have)).to(dst.dtype))
            loaded.add(name)
        if tie:
            params["lm_head.weight"].copy_(params["model.embed_tokens.weight"])
