"""The configuration checks that need the model itself (its config.json and the draft's): run
by `glm53-serve up` before anything starts and by each instance before it loads weights."""

from __future__ import annotations

from pathlib import Path

from glm53.server.config import ROLES, ClusterConfig, ConfigError


def check_model_fit(cfg: ClusterConfig, model_dir: str | Path) -> None:
    """The checks that need the model's config.json: every instance's tp (with its ep expert
    groups) must split the model's heads, experts, expert widths and vocabulary evenly, and under
    dtype "auto" each rank's part of a block-FP8 weight must be whole 128-blocks (which weights
    are FP8: the checkpoint index's names, no weight read); the DFlash draft (if on) must fit the
    model and split by every tp too (ConfigError naming the key and the model or draft field)."""
    from glm53.models.config import ConfigError as ModelConfigError
    from glm53.models.config import GlmConfig
    from glm53.models.draft_config import check_draft_tp
    from glm53.models.draft_weights import draft_config
    from glm53.models.parallel import check_tp

    model = GlmConfig.from_dir(model_dir)
    fp8 = _fp8_names(model, model_dir)
    draft = None
    if cfg.speculative.enabled:
        path = cfg.speculative.draft_model_path
        try:  # config.json and the heads' tensor names and shapes: no weight is read
            draft = draft_config(path, model)
        except (ModelConfigError, OSError, ValueError) as e:
            raise ConfigError(cfg.source, "speculative.draft_model_path", f"{path}: {e}") from None
        _check_draft_family(cfg, draft, path)
    if cfg.speculative.nextn:
        _check_nextn_layer(cfg, model, model_dir)
    for role in ROLES:
        for i, inst in enumerate(cfg.pool(role)):
            if inst.pp > model.num_hidden_layers:
                raise ConfigError(cfg.source, f"{role}[{i}].pp", f"{inst.pp} stages for a model of "
                                  f"{model.num_hidden_layers} layers (model {model_dir})")
            if inst.engine.kv_cache_dtype == "fp8_e4m3":
                _check_fp8_kv(cfg, model, f"{role}[{i}].kv_cache_dtype", model_dir)
            try:
                check_tp(model, inst.tp, fp8 if inst.engine.dtype == "auto" else (), ep=inst.ep)
                if draft is not None:
                    check_draft_tp(draft, inst.tp)
            except ModelConfigError as e:
                key = "ep" if "expert_parallel_size" in str(e) else "tp"
                raise ConfigError(cfg.source, f"{role}[{i}].{key}", f"{e} (model {model_dir})") from None


def _check_draft_family(cfg: ClusterConfig, draft, path) -> None:
    """The algorithm asked for against the draft's checkpoint (a DSpark draft carries a Markov
    head), the verify width against its block, a confidence cut against its confidence head."""
    spec = cfg.speculative
    if draft.algorithm != spec.algorithm:
        why = " (no markov_head.* tensors)" if draft.algorithm == "DFLASH" else "; use algorithm DSPARK"
        raise ConfigError(cfg.source, "speculative.algorithm",
                          f"{spec.algorithm}: {path} is a {draft.algorithm} draft{why}")
    key = "dspark_block_size" if spec.algorithm == "DSPARK" and spec.dspark_block_size is not None \
        else "num_draft_tokens"
    n = spec.verify_width
    if n is not None and n > draft.block_size:
        raise ConfigError(cfg.source, f"speculative.{key}", f"{n} is larger than the draft's block size {draft.block_size}")
    if spec.dspark_confidence_threshold > 0 and not draft.confidence_head:
        raise ConfigError(cfg.source, "speculative.dspark_confidence_threshold",
                          f"{spec.dspark_confidence_threshold}: {path} has no confidence head (confidence_head.proj.*)")


def _check_nextn_layer(cfg: ClusterConfig, model, model_dir) -> None:
    """NEXTN needs the checkpoint's MTP layer: num_nextn_predict_layers >= 1 and its tensors
    (read from the index's names; no weight is read)."""
    from glm53.models.config import ConfigError as ModelConfigError
    from glm53.models.mtp import nextn_spec
    from glm53.models.weights import WeightError, checkpoint_files

    try:
        names = checkpoint_files(Path(model_dir))
    except (WeightError, OSError):
        names = None  # a config.json without its weights (planning): the config alone
    try:
        if names is not None or model.num_nextn_predict_layers < 1:
            nextn_spec(model, names or ())
    except ModelConfigError as e:
        raise ConfigError(cfg.source, "speculative.algorithm",
                          f"{cfg.speculative.algorithm}: model {model_dir}: {e}") from None


def _fp8_names(model, model_dir) -> frozenset[str]:
    """The parameters a block-FP8 checkpoint stores FP8, from its tensor names (empty when the
    model is not block-FP8 or its files are not there to read)."""
    from glm53.models.weights import WeightError, checkpoint_files, fp8_param_names

    if model.quant_method != "fp8":
        return frozenset()
    try:
        return fp8_param_names(model, checkpoint_files(Path(model_dir)))
    except WeightError:
        return frozenset()


def _check_fp8_kv(cfg: ClusterConfig, model, key: str, model_dir) -> None:
    """The FP8 latent row needs kv_lora_rank % 4 == 0 and an even rope width (its fp32 and bf16
    parts stay aligned); the FP8 indexer keys a power-of-two index_head_dim (the Triton kernel's
    tile width; it is also the width the Hadamard rotation needs)."""
    from glm53.kernels.latent_cache_fp8 import LatentLayout

    try:
        LatentLayout.for_config(model)
    except ValueError as e:
        raise ConfigError(cfg.source, key, f"{e} (model {model_dir})") from None
    d = model.index_head_dim
    if d & (d - 1):
        raise ConfigError(cfg.source, key, f"FP8 indexer keys need a power-of-two index_head_dim, the model has {d} "
                          f"(model {model_dir})")
