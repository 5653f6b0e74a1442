"""Load a Hugging Face GLM-5 checkpoint (`model.safetensors.index.json` + shards, or a single
`model.safetensors`) into `GlmForCausalLM`.

Missing or unexpected tensors are errors that name them. Indexer weights must exist exactly on
the schedule's "full" layers. MTP layers (ids ≥ num_hidden_layers) are skipped with one log line.

Block-FP8 checkpoints (`quantization_config.quant_method: fp8`, an fp32 `<name>.weight_scale_inv`
beside each e4m3 `<name>.weight`): which weights are FP8 is read from the checkpoint's tensor
names (`fp8_param_names`), never assumed by layer type. A model built with those names
(`GlmForCausalLM(fp8=...)`; `load_model(..., fp8=True)`) holds them e4m3 with their scales, read
as stored; a weight the model holds in its dtype is dequantised at load (all of them for a model
built without names, i.e. `--dtype bfloat16`; kv_b_proj always, see model.py).

The loader is generic over tensor parallelism: each parameter's shard rule (`sharding.Shard`)
says which part of its checkpoint tensor this rank holds, and only that part is read
(`safe_open(...).get_slice(name)[...]`): a kept-FP8 weight's scales are a parameter with their
own rule; a dequantised part reads the scale blocks covering it. Replicated tensors are read whole.
Under expert parallelism a rank's routed-expert stacks hold a range of the experts (the rule's
`experts`): the other experts' tensors (and their scales) are never read, nor their files opened
when they hold nothing else this rank needs.

`load_model` is the streaming loader: the stage is built on the meta device, allocated on the
target device (`layers.materialize_`), and each tensor goes from its file straight into its
parameter there, as this rank's slice, in its checkpoint dtype (FP8 stays FP8). Files are opened
one at a time, so the host holds one tensor (and the mapped pages of one file) at a time, never
the stage.
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
from glm53.models.layers import FP8, SCALE_SUFFIX, materialize_
from glm53.models.model import GlmForCausalLM
from glm53.models.parallel import TPGroup
from glm53.models.sharding import shard_of

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Routed experts: stacked [E, ...] in the model as `<layer>.mlp.experts.<proj>` (block-FP8 scales
# `<proj>_scale_inv`), stored per expert in the checkpoint as `<layer>.mlp.experts.<e>.<proj>.weight`
# (and `.weight_scale_inv`).
_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)(_scale_inv)?$")
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # per-expert checkpoint order
_SCALE_SUFFIX = SCALE_SUFFIX


# The tensors GLM-5-FP8 stores block-FP8 (each with a `.weight_scale_inv`): the five MLA projections,
# the indexer's wq_b and wk, and gate/up/down of the dense MLPs, the shared experts and every routed
# expert. Not: embed_tokens, lm_head, the norms (indexer k_norm included), the router (mlp.gate,
# e_score_correction_bias), the indexer's weights_proj. (../shared/reference/dsa.md §1.2, the FP8
# build's names and shapes; DeepSeek-V3's FP8 release has the same rule for the same layers.) Used
# only where there is no checkpoint to read the names from: `plan` and the slice tools.
_GLM5_FP8_TENSOR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b|indexer\.wk)"
    r"|mlp\.((experts\.\d+|shared_experts)\.)?(gate_proj|up_proj|down_proj))\.weight$")


def fp8_in_glm5(name: str) -> bool:
    """Whether GLM-5-FP8 stores checkpoint tensor `name` block-FP8."""
    return _GLM5_FP8_TENSOR.match(name) is not None


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


def param_of(name: str) -> tuple[str, int | None]:
    """The model parameter a checkpoint tensor loads into, and the expert row of a stacked one."""
    m = _EXPERT.match(name)
    if m is None:
        return name, None
    return f"{m.group(1)}.{m.group(3)}{m.group(4) or ''}", int(m.group(2))


def fp8_param_names(cfg: GlmConfig, names) -> frozenset[str]:
    """The parameters (model naming) whose checkpoint tensors are block-FP8: every `X.weight` with
    an `X.weight_scale_inv` beside it, and a routed-expert stack when every expert's tensor is.
    Read from the tensor names alone (the index: no weight is read), for every layer; empty unless
    `quantization_config.quant_method` is fp8."""
    names = set(names)
    if cfg.quant_method != "fp8":
        return frozenset()
    out: set[str] = set()
    experts: dict[str, int] = {}
    for n in names:
        if not n.endswith(".weight" + _SCALE_SUFFIX):
            continue
        w = n[: -len(_SCALE_SUFFIX)]
        if w not in names:
            raise WeightError(f"{n}: a block-FP8 scale without its weight {w}")
        p, e = param_of(w)
        if e is None:
            out.add(p)
        else:
            experts[p] = experts.get(p, 0) + 1
    return frozenset(out | {p for p, k in experts.items() if k == cfg.n_routed_experts})


def glm5_fp8_param_names(cfg: GlmConfig, model: nn.Module) -> frozenset[str]:
    """`fp8_param_names` for a block-FP8 config.json without its checkpoint (planning): the
    GLM-5-FP8 layout (`fp8_in_glm5`) applied to the tensors `model` (built without FP8, on the
    meta device) would load. Empty unless `quantization_config.quant_method` is fp8."""
    if cfg.quant_method != "fp8":
        return frozenset()
    names = [n for n in checkpoint_tensors(model) if fp8_in_glm5(n)]
    return fp8_param_names(cfg, names + [n + _SCALE_SUFFIX for n in names])


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
    (expert e's gate, up, down before expert e + 1's), as Hugging Face checkpoints list them;
    all E of the checkpoint also on an expert-parallel rank that holds a range of them.
    A block-FP8 weight (e4m3) is followed by its `.weight_scale_inv` (fp32).
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
            stacks = [(f"{proj}.weight{suffix}", params[f"{m.group(1)}.{proj}{suffix}"])
                      for proj in _EXPERT_PROJS for suffix in ("", _SCALE_SUFFIX)
                      if f"{m.group(1)}.{proj}{suffix}" in params]
            for e in range(shard_of(p).n_experts or p.shape[0]):
                for tensor, q in stacks:
                    out[f"{m.group(1)}.{e}.{tensor}"] = (shard_of(q).full_shape(q.shape[1:]), q.dtype)
    return out


class CheckpointReader:
    """Reads checkpoint tensors, whole or one part, opening a file when first needed; `close`
    closes every file open (the loader calls it between files, so one file's mapping at a time).
    `read` returns block-FP8 weights dequantised to fp32, `read(..., raw=True)` as stored."""

    def __init__(self, files: dict[str, Path], cfg: GlmConfig):
        self.files, self.cfg = files, cfg
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._handles[path]

    def close(self) -> None:
        self._stack.close()
        self._stack = ExitStack()
        self._handles.clear()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] | None, raw: bool = False) -> torch.Tensor:
        """The tensor `name`, or only its part `index` (explicit start/stop on every dimension)."""
        h = self._handle(name)
        t = h.get_tensor(name) if index is None else h.get_slice(name)[index]
        scale_name = name + _SCALE_SUFFIX
        if not raw and self.cfg.quant_method == "fp8" and scale_name in self.files:
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
    """Fills `model`'s parameters (on whatever device they are) from the checkpoint in `model_dir`,
    this rank's part of each, file by file."""
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
        if name.endswith(_SCALE_SUFFIX) and cfg.quant_method == "fp8" and name not in expected:
            continue  # read with its weight, which the model holds dequantised (or another stage's)
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
    todo = [n for n in todo if _held(n, params)]  # another expert-parallel rank's experts: not read
    if mtp_layers:
        log.info("skipping MTP layer(s) %s (num_nextn_predict_layers=%d)", sorted(mtp_layers), cfg.num_nextn_predict_layers)

    # File by file (first appearance order), so one file is open at a time.
    rank = {path: i for i, path in enumerate(dict.fromkeys(files[n] for n in todo))}
    todo.sort(key=lambda n: rank[files[n]])
    reader = CheckpointReader(files, cfg)
    current = None
    with torch.no_grad():
        bar = tqdm(todo, desc="loading weights", unit="tensor", file=sys.stderr, disable=not progress, leave=False)
        try:
            for name in bar:
                if files[name] != current:
                    reader.close()
                    current = files[name]
                pname, e = param_of(name)
                p = params[pname]
                rule = shard_of(p)
                dst = p if e is None else p[rule.expert_row(e)]
                have, want = reader.shape(name), rule.full_shape(dst.shape)
                if have != want:
                    raise WeightError(f"{name}: shape {have} in the checkpoint, model expects {want}")
                raw = dst.dtype == FP8 or name.endswith(_SCALE_SUFFIX)
                t = reader.read(name, rule.index(have), raw=raw)
                if dst.dtype == FP8 and t.dtype != FP8:
                    raise WeightError(f"{name}: stored as {t.dtype}, but the model holds it block-FP8 (float8_e4m3fn)")
                dst.copy_(t.to(dst.dtype))  # straight into the parameter, on its device
                loaded.add(name)
        finally:
            reader.close()
        if tie:
            params["lm_head.weight"].copy_(params["model.embed_tokens.weight"])


def _held(name: str, params: dict[str, nn.Parameter]) -> bool:
    """Whether this rank holds (a part of) checkpoint tensor `name`: false only for a routed
    expert outside its parameter's expert range."""
    pname, e = param_of(name)
    return e is None or shard_of(params[pname]).holds_expert(e)


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    layers: range | None = None,
    tp: TPGroup | None = None,
    fp8: bool = True,
    progress: bool = True,
    ep: int = 1,
) -> GlmForCausalLM:
    """The streaming loader: the stage holding `layers` (all by default; this rank's shard under
    `tp`, and its experts' range under `ep`) built on the meta device, allocated on `device` and
    filled tensor by tensor from `model_dir` (module docstring). `fp8`: keep the checkpoint's
    block-FP8 weights e4m3 with their scales (the rest in `dtype`); False dequantises them to
    `dtype` at load."""
    model_dir = Path(model_dir)
    cfg = GlmConfig.from_dir(model_dir)
    names = fp8_param_names(cfg, checkpoint_files(model_dir)) if fp8 else frozenset()
    with torch.device("meta"):
        model = GlmForCausalLM(cfg, dtype=dtype, layers=layers, tp=tp, fp8=names, ep=ep)
    materialize_(model, device)
    model.init_buffers(device)
    load_weights(model, model_dir, progress=progress)
    return model
