"""Load a DFlash draft checkpoint (`model.safetensors` or an index + shards, tensor names as the
published drafts have them: `layers.{i}.…`, `fc.weight`, `hidden_norm.weight`, `norm.weight`,
optionally under a `model.` prefix) into `DFlashDraft`, or only the `fc` column blocks a
pipeline stage needs into a `DraftProjection`. A DSpark draft is the same layout plus
`markov_head.markov_w{1,2}.weight` [V, r] and optionally `confidence_head.proj.{weight,bias}`
([1, H + r], [1]); `draft_config` reads r and the confidence head's presence from the tensors.

Like the target's loader: missing or unexpected tensors are `WeightError`s naming them, shapes
are checked against the parameter's shard rule, and a tensor-parallel rank reads only its slice.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import dataclasses

import torch
from safetensors import safe_open

from glm53.kernels.dispatch import cpu_multiplies_bf16
from glm53.models.config import GlmConfig
from glm53.models.draft import DFlashDraft
from glm53.models.draft_projection import DraftProjection
from glm53.models.draft_config import DFlashConfig
from glm53.models.parallel import TPGroup
from glm53.models.sharding import shard_of
from glm53.models.weights import WeightError, _names, checkpoint_files

_PREFIX = "model."


def draft_checkpoint_tensors(draft: DFlashDraft) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor a draft checkpoint holds: name -> (full shape, also on a TP shard; dtype as
    the model holds it), in parameter order. Works on a draft built on the meta device."""
    return {name: (shard_of(p).full_shape(p.shape), p.dtype) for name, p in draft.named_parameters()}


def _checkpoint_names(draft_dir: Path) -> dict[str, tuple[str, Path]]:
    """Parameter name -> (tensor name in the checkpoint, file), with the `model.` prefix dropped."""
    out: dict[str, tuple[str, Path]] = {}
    for name, path in checkpoint_files(draft_dir).items():
        key = name[len(_PREFIX) :] if name.startswith(_PREFIX) else name
        if key in out:
            raise WeightError(f"{draft_dir}: {name} and {out[key][0]} name the same tensor")
        out[key] = (name, path)
    return out


class _Reader:
    def __init__(self, stack: ExitStack):
        self.stack = stack
        self.handles: dict[Path, object] = {}

    def slice(self, name: str, path: Path):
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(safe_open(str(path), framework="pt"))
        return self.handles[path].get_slice(name)


_MARKOV = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
_CONFIDENCE = ("confidence_head.proj.weight", "confidence_head.proj.bias")


def draft_config(draft_dir: str | Path, target: GlmConfig) -> DFlashConfig:
    """The draft's config (config.json, checked against `target`) with its DSpark heads as the
    checkpoint's tensors give them: the Markov rank r (0: none) and the confidence head."""
    draft_dir = Path(draft_dir)
    cfg = DFlashConfig.from_dir(draft_dir, target)
    files = _checkpoint_names(draft_dir)
    have = [k for k in _MARKOV if k in files]
    if not have:
        extra = [files[k][0] for k in _CONFIDENCE if k in files]
        if extra:
            raise WeightError(f"{draft_dir}: {_names(extra)} without a Markov head (markov_head.*): not a DSpark draft")
        return cfg
    if len(have) == 1:
        missing = [k for k in _MARKOV if k not in files]
        raise WeightError(f"{draft_dir}: tensors missing from the draft checkpoint: {_names(missing)}")
    shapes = {}
    with ExitStack() as stack:
        reader = _Reader(stack)
        for k in _MARKOV:
            shapes[k] = tuple(reader.slice(*files[k]).get_shape())
    w1 = shapes[_MARKOV[0]]
    if len(w1) != 2 or w1[0] != target.vocab_size or shapes[_MARKOV[1]] != w1 or w1[1] < 1:
        raise WeightError(f"{files[_MARKOV[0]][0]}, {files[_MARKOV[1]][0]}: shapes {w1}, {shapes[_MARKOV[1]]}; a "
                          f"Markov head needs both [vocab={target.vocab_size}, r] with r >= 1")
    conf = [k in files for k in _CONFIDENCE]
    if any(conf) and not all(conf):
        missing = [k for k, c in zip(_CONFIDENCE, conf) if not c]
        raise WeightError(f"{draft_dir}: tensors missing from the draft checkpoint: {_names(missing)}")
    return dataclasses.replace(cfg, markov_rank=w1[1], confidence_head=all(conf))


def cpu_bf16_drafting(device: torch.device | str, dtype: torch.dtype, tp_size: int) -> bool:
    """The default of `DFlashDraft.cpu_bf16`: an fp32 draft on a CPU that multiplies bf16
    natively, without TP (bf16 partial products summed across ranks round unlike one whole
    product, and every rank count must propose the same tokens)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and tp_size == 1 and cpu_multiplies_bf16()


def build_draft(draft_dir: str | Path, target: GlmConfig, dtype: torch.dtype = torch.float32,
                tp: TPGroup | None = None, confidence_threshold: float = 0.0, cpu_bf16: bool = False) -> DFlashDraft:
    """The draft at `draft_dir` (DFlash or DSpark, this rank's shard under `tp`), loaded. A
    DSpark draft cuts its blocks at `confidence_threshold` (0: never); `cpu_bf16` as
    `DFlashDraft`'s."""
    draft = DFlashDraft(draft_config(draft_dir, target), target, dtype=dtype, tp=tp,
                        confidence_threshold=confidence_threshold, cpu_bf16=cpu_bf16)
    load_draft_weights(draft, draft_dir)
    return draft


def load_draft_weights(draft: DFlashDraft, draft_dir: str | Path) -> None:
    """Fills every parameter of `draft` (this rank's shard) from the checkpoint at `draft_dir`."""
    draft_dir = Path(draft_dir)
    files = _checkpoint_names(draft_dir)
    params = dict(draft.named_parameters())
    unexpected = [files[k][0] for k in files if k not in params]
    if unexpected:
        raise WeightError(f"{draft_dir}: unexpected tensors in the draft checkpoint: {_names(unexpected)}")
    missing = [k for k in params if k not in files]
    if missing:
        raise WeightError(f"{draft_dir}: tensors missing from the draft checkpoint: {_names(missing)}")
    with ExitStack() as stack, torch.no_grad():
        reader = _Reader(stack)
        for key, p in params.items():
            name, path = files[key]
            sl = reader.slice(name, path)
            rule = shard_of(p)
            have, want = tuple(sl.get_shape()), rule.full_shape(p.shape)
            if have != want:
                raise WeightError(f"{name}: shape {have} in the draft checkpoint, model expects {want}")
            idx = rule.index(have)
            p.copy_((sl[:] if idx is None else sl[idx]).to(p.dtype))


def load_draft_projection(
    draft_dir: str | Path, target_cfg: GlmConfig, layers: range, dtype: torch.dtype = torch.float32
) -> DraftProjection:
    """The `fc` column blocks of the feature layers within the target layers `layers` (a
    pipeline stage's), read from the draft checkpoint. Feature ids increase, so a stage's blocks
    are one contiguous column range."""
    draft_dir = Path(draft_dir)
    cfg = DFlashConfig.from_dir(draft_dir, target_cfg)
    ks = [k for k, i in enumerate(cfg.target_layer_ids) if i in layers]
    h = cfg.hidden_size
    files = _checkpoint_names(draft_dir)
    if "fc.weight" not in files:
        raise WeightError(f"{draft_dir}: tensors missing from the draft checkpoint: fc.weight")
    name, path = files["fc.weight"]
    with safe_open(str(path), framework="pt") as f:
        sl = f.get_slice(name)
        have, want = tuple(sl.get_shape()), (h, cfg.num_features * h)
        if have != want:
            raise WeightError(f"{name}: shape {have} in the draft checkpoint, model expects {want}")
        w = sl[:, ks[0] * h : (ks[-1] + 1) * h] if ks else torch.empty(h, 0)
    return DraftProjection(w.to(dtype), tuple(cfg.target_layer_ids[k] for k in ks))
