"""The embedded default model: a tiny GLM-5 (`glm_moe_dsa`) trained on Python source, and its
DFlash and DSpark drafts, all shipped in `assets/` and installed into `$GLM53_CACHE` on first use.

`embedded:tiny-glm5` is the trained target (assets/tiny-glm5, made by tools/train_tiny.py): laid
out exactly like a Hugging Face GLM-5 checkpoint (config.json, generation_config.json,
model.safetensors in bf16, tokenizer.json, tokenizer_config.json, chat_template.jinja), so
everything that serves it serves the real model too. `embedded:tiny-glm5-dflash` is its trained
DFlash draft (assets/tiny-glm5-dflash, the published DFlash layout, block size 16), and
`embedded:tiny-glm5-dspark` its trained DSpark draft (assets/tiny-glm5-dspark: the same layout plus
Markov and confidence heads). Nothing is downloaded.

The random tiny model stays available (`ensure_random_model`, `write_embedded_model`): the same
layout with deterministic random weights of `MODEL_DIMS`, for tests that need arbitrary configs.
The tokenizer of both is a byte-level BPE trained with `tokenizers` on the Python standard
library's source, plus GLM's special tokens.

Dimensions are small enough for quick CPU serving but keep every GLM-5 feature live: MLA with
q/kv LoRA, a DSA indexer with index_topk 64 (so prompts longer than 64 tokens are sparse), cross-
layer index sharing (indexer_types mixes "full" and "shared"), a dense first layer, and grouped
sigmoid-routed MoE with a shared expert.

Installation is atomic: the checkpoint is built (copied) in a temporary directory and renamed
into place under an exclusive file lock, so concurrent `up`s neither corrupt nor duplicate it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glm53.server.config import (EMBEDDED_DRAFT, EMBEDDED_DSPARK, EMBEDDED_MODEL, EMBEDDED_RANDOM, ClusterConfig,
                                  ConfigError)

if TYPE_CHECKING:  # imported lazily: resolving an existing model path must stay cheap
    import torch

log = logging.getLogger(__name__)

# Bump when the shipped checkpoints' content changes, so old caches are not reused.
# v1: random weights; v2: the trained pair of tools/train_tiny.py (assets/); v3: the same target
# with the self-distilled 3-layer draft of tools/distill_draft.py; v4: that draft distilled again
# on 16x more generated data (tools/distill_draft.py's lockstep generation); v5: that draft trained on
# for 380 s more (held-out τ at block 16 4.92 -> 5.92); v6: the target gains a trained MTP layer
# (num_nextn_predict_layers 1, tools/train_mtp.py; the target's own tensors unchanged); v7: that
# layer trained on (2x the data, 122 steps; held-out httpx τ at 3 steps 1.55 -> 1.75); v8: that layer
# trained on on the H200 (158K sequences, 4,468 steps of 64; httpx τ 1.75 -> 2.92); v9: the draft
# distilled on for 226 s on the stdlib plus third-party sources (tools/build_corpus.py; held-out
# transformers τ at block 16 3.09 -> 3.84, httpx 3.88 -> 4.22); v10: the draft distilled on jointly
# with the DSpark draft (tools/distill_draft.py --dspark-joint; replayed transformers τ at block 16
# 5.29 -> 5.47).
EMBEDDED_VERSION = 10  # also names the DSpark draft's cache directory
EMBEDDED_DIRNAME = f"tiny-glm5-v{EMBEDDED_VERSION}"
EMBEDDED_DRAFT_DIRNAME = f"tiny-glm5-dflash-v{EMBEDDED_VERSION}"
EMBEDDED_DSPARK_DIRNAME = f"tiny-glm5-dspark-v{EMBEDDED_VERSION}"
# The random model (its own version: bump when write_embedded_model's output changes).
RANDOM_VERSION = 1
RANDOM_DIRNAME = f"tiny-glm5-random-v{RANDOM_VERSION}"
ASSETS = Path(__file__).resolve().parents[2] / "assets"  # the repository root's assets/
SEED = 0x61A5
BPE_VOCAB = 4096
TRAIN_TEXT_BYTES = 3_000_000

# GLM's special tokens, in GLM's order. `special` ones are control tokens hidden by
# skip_special_tokens; the reasoning/tool markers stay visible in decoded text (parsers need them).
SPECIAL_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("[MASK]", True), ("[gMASK]", True), ("[sMASK]", True),
    ("<sop>", True), ("<eop>", True), ("<|system|>", True), ("<|user|>", True),
    ("<|assistant|>", True), ("<|observation|>", True), ("<|begin_of_image|>", True),
    ("<|end_of_image|>", True), ("<think>", False), ("</think>", False), ("<tool_call>", False),
    ("</tool_call>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<arg_key>", False), ("</arg_key>", False), ("<arg_value>", False), ("</arg_value>", False),
    ("/nothink", False),
]
# As GLM-5: generation ends at <|endoftext|>, or when the model starts a user/observation turn.
EOS_TOKENS = ["<|endoftext|>", "<|user|>", "<|observation|>"]

MODEL_DIMS: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "index_n_heads": 8,
    "index_head_dim": 64,
    "index_topk": 64,
    "index_topk_freq": 2,
    "index_skip_topk_offset": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 8192,
}

CHAT_TEMPLATE = """\
{#- GLM-style chat template of the embedded tiny model (same markup as GLM-5). -#}
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}{%- if part is mapping and part.type == 'text' -%}{{ part.text }}{%- elif part is string -%}{{ part }}{%- endif -%}{%- endfor -%}
{%- elif content is none -%}
{%- else -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>{{ text(m.content) }}
{%- elif m.role == 'user' -%}
<|user|>{{ text(m.content) }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning = m.reasoning_content or m.reasoning or '' -%}
{%- if reasoning -%}<think>{{ reasoning }}</think>{%- else -%}</think>{%- endif -%}
{{ text(m.content) }}
{%- for call in m.tool_calls or [] -%}
{%- set f = call.function if call.function is defined else call -%}
<tool_call>{{ f.name }}
{%- set args = f.arguments -%}
{%- if args is string -%}{{ args }}{%- else -%}
{%- for k, v in args.items() -%}<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else (v | tojson) }}</arg_value>{%- endfor -%}
{%- endif -%}</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
<|observation|><tool_response>{{ text(m.content) }}</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{%- if enable_thinking is defined and not enable_thinking -%}</think>{%- else -%}<think>{%- endif -%}
{%- endif -%}
"""


def cache_root() -> Path:
    return Path(os.environ.get("GLM53_CACHE") or Path.home() / ".cache" / "glm53-serve")


def resolve_model_path(path: str) -> Path:
    """A config's model.path as a directory, installing the embedded model when it is named."""
    if path == EMBEDDED_MODEL:
        return ensure_embedded_model()
    if path == EMBEDDED_RANDOM:
        return ensure_random_model()
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model path {path!r} is not a model directory (no config.json)")
    return p


def resolve_draft_path(path: str) -> Path:
    """A config's speculative.draft_model_path as a directory, installing the embedded draft
    when `embedded:tiny-glm5-dflash` or `embedded:tiny-glm5-dspark` is named."""
    if path == EMBEDDED_DRAFT:
        return ensure_embedded_draft()
    if path == EMBEDDED_DSPARK:
        return ensure_embedded_dspark()
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"draft path {path!r} is not a draft directory (no config.json)")
    return p


def resolve_paths(cfg: ClusterConfig) -> tuple[Path, ClusterConfig]:
    """The model directory, and `cfg` with its draft path made a directory too (installing the
    embedded ones when named); a missing directory is a ConfigError naming the key."""
    try:
        model_dir = resolve_model_path(cfg.model.path)
    except FileNotFoundError as e:
        raise ConfigError(cfg.source, "model.path", str(e)) from None
    spec = cfg.speculative
    if spec.enabled and spec.draft_model_path:
        try:
            draft = resolve_draft_path(spec.draft_model_path)
        except FileNotFoundError as e:
            raise ConfigError(cfg.source, "speculative.draft_model_path", str(e)) from None
        cfg = dataclasses.replace(cfg, speculative=dataclasses.replace(spec, draft_model_path=str(draft)))
    return model_dir, cfg


def check_tokenizer(cfg: ClusterConfig, model_dir: Path) -> None:
    """The router needs the model's tokenizer.json unless it serves token ids only; instances
    never do (stop strings load it lazily, and the router refuses them without one)."""
    if not cfg.model.skip_tokenizer_init and not (model_dir / "tokenizer.json").is_file():
        raise ConfigError(cfg.source, "model.path", f"{model_dir} has no tokenizer.json (the router needs a "
                          "tokenizers-format tokenizer); to serve token ids only, set model.skip_tokenizer_init: "
                          "true (--skip-tokenizer-init)")


def ensure_embedded_model(root: Path | None = None) -> Path:
    """The trained embedded checkpoint's directory, installed (once, atomically) if missing."""
    return _ensure(root, EMBEDDED_DIRNAME, lambda out: _copy_asset("tiny-glm5", out))


def ensure_embedded_draft(root: Path | None = None) -> Path:
    """The embedded model's trained DFlash draft, installed (once, atomically) if missing."""
    return _ensure(root, EMBEDDED_DRAFT_DIRNAME, lambda out: _copy_asset("tiny-glm5-dflash", out))


def ensure_embedded_dspark(root: Path | None = None) -> Path:
    """The embedded model's trained DSpark draft, installed (once, atomically) if missing."""
    return _ensure(root, EMBEDDED_DSPARK_DIRNAME, lambda out: _copy_asset("tiny-glm5-dspark", out))


def ensure_random_model(root: Path | None = None) -> Path:
    """The random tiny checkpoint (MODEL_DIMS, deterministic weights), created if missing."""
    return _ensure(root, RANDOM_DIRNAME, write_embedded_model)


def _copy_asset(name: str, out: Path) -> None:
    src = ASSETS / name
    if not (src / "config.json").is_file() or not (src / "model.safetensors").is_file():
        raise FileNotFoundError(f"the shipped checkpoint {src} is missing (a source checkout has it under assets/)")
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(".log"):
            shutil.copyfile(f, out / f.name)


def _ensure(root: Path | None, dirname: str, write) -> Path:
    root = Path(root) if root is not None else cache_root()
    final = root / dirname
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{dirname}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # whoever waited here finds the finished directory
        if (final / "config.json").is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{dirname}.", dir=root))
        try:
            log.info("installing the embedded checkpoint %s in %s", dirname, final)
            write(tmp)
            if final.exists():  # a partial directory from an older, interrupted layout
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_embedded_model(out: Path) -> None:
    """The random tiny model (MODEL_DIMS) into `out`; tools/train_tiny.py also writes the
    trained model's small files with it (then replaces the weights)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t, _ in SPECIAL_TOKENS}
    vocab = _round_up(tok.get_vocab_size(with_added_tokens=True), 64)
    config = model_config(vocab, ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "do_sample": True,
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "temperature": 1.0,
        "top_p": 0.95,
    }, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "padding_side": "left",
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                          "single_word": False, "special": special}
            for t, special in SPECIAL_TOKENS
        },
    }, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    write_weights(config, out / "model.safetensors")


def model_config(vocab_size: int, special_ids: dict[str, int]) -> dict[str, Any]:
    d = MODEL_DIMS
    L = d["num_hidden_layers"]
    freq, offset = d["index_topk_freq"], d["index_skip_topk_offset"]
    indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "eos_token_id": [special_ids[t] for t in EOS_TOKENS],
        "pad_token_id": special_ids["<|endoftext|>"],
        "ep_size": 1,
        "first_k_dense_replace": d["first_k_dense_replace"],
        "head_dim": d["qk_rope_head_dim"],
        "hidden_act": "silu",
        "hidden_size": d["hidden_size"],
        "index_head_dim": d["index_head_dim"],
        "index_n_heads": d["index_n_heads"],
        "index_topk": d["index_topk"],
        "index_topk_freq": freq,
        "index_skip_topk_offset": offset,
        "indexer_types": indexer_types,
        "indexer_rope_interleave": True,
        "initializer_range": 0.02,
        "intermediate_size": d["intermediate_size"],
        "kv_lora_rank": d["kv_lora_rank"],
        "max_position_embeddings": d["max_position_embeddings"],
        "moe_intermediate_size": d["moe_intermediate_size"],
        "moe_layer_freq": 1,
        "n_group": d["n_group"],
        "n_routed_experts": d["n_routed_experts"],
        "n_shared_experts": d["n_shared_experts"],
        "norm_topk_prob": True,
        "num_attention_heads": d["num_attention_heads"],
        "num_experts_per_tok": d["num_experts_per_tok"],
        "num_hidden_layers": L,
        "num_key_value_heads": d["num_key_value_heads"],
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "q_lora_rank": d["q_lora_rank"],
        "qk_head_dim": d["qk_nope_head_dim"] + d["qk_rope_head_dim"],
        "qk_nope_head_dim": d["qk_nope_head_dim"],
        "qk_rope_head_dim": d["qk_rope_head_dim"],
        "rms_norm_eps": 1e-5,
        "rope_interleave": True,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": d["topk_group"],
        "topk_method": "noaux_tc",
        "use_cache": True,
        "v_head_dim": d["v_head_dim"],
        "vocab_size": vocab_size,
    }


def weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of the checkpoint: name -> (shape, dtype), in HF GLM-5 naming and in the
    order the values are drawn. Names, shapes and order come from the model itself (built on the
    meta device, mapped by the loader's inverse); the dtypes are this checkpoint's storage choice:
    bf16, except the router's correction bias in fp32 (as GLM-5 ships it). The model computes
    the router and the indexer head gates in fp32 and upcasts them at load."""
    import torch

    from glm53.models.config import GlmConfig
    from glm53.models.model import GlmForCausalLM
    from glm53.models.weights import checkpoint_tensors

    glm = GlmConfig.from_dict(cfg)
    with torch.device("meta"):
        models = [GlmForCausalLM(glm, dtype=torch.bfloat16)]
        if glm.num_nextn_predict_layers:  # the MTP layer (models/mtp.py), after the target's tensors
            from glm53.models.mtp import NextNDraft, NextNSpec

            spec = NextNSpec(glm.num_hidden_layers, moe=True, own_head=False, own_embed=False, fp8=False)
            models.append(NextNDraft(glm, spec, dtype=torch.bfloat16))
    return {
        name: (shape, torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16)
        for model in models for name, (shape, _) in checkpoint_tensors(model).items()
        if not name.startswith("model.embed_tokens") or model is models[0]
    }


def write_weights(cfg: dict[str, Any], path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(SEED)
    tensors: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in weight_shapes(cfg).items():
        tensors[name] = _init(name, shape, g).to(dtype).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _init(name: str, shape: tuple[int, ...], g: "torch.Generator") -> "torch.Tensor":
    import torch

    # Scale so activations neither vanish nor explode through the layers (fan-in scaling), and
    # logits spread by a few units, so greedy argmax is rarely a near-tie that float reordering
    # between batch shapes could flip.
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0 + 0.05 * torch.randn(shape, generator=g)
    if name.endswith("k_norm.bias"):
        return 0.05 * torch.randn(shape, generator=g)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=g)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=g)
    if name == "lm_head.weight":
        return 4.0 * torch.randn(shape, generator=g) / shape[1] ** 0.5
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5


def train_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, s in SPECIAL_TOKENS if s])
    # Added in GLM's order, so ids are contiguous after the BPE vocabulary.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, s in SPECIAL_TOKENS if not s])
    return tok


def _training_text():
    """Python standard library sources, in a fixed order, up to TRAIN_TEXT_BYTES."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for f in sorted(stdlib.glob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        total += len(text)
        if total >= TRAIN_TEXT_BYTES:
            return
    if total == 0:  # a Python without its sources: still a usable byte-level tokenizer
        yield "def main():\n    return 0\n" * 100


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
