"""The configuration checks that need the model itself (its config.json and the draft's): run
by `glm53-serve up` before anything starts and by each instance before it loads weights."""

from __future__ import annotations

from pathlib import Path

from glm53.server.config import ROLES, ClusterConfig, ConfigError


def check_model_fit(cfg: ClusterConfig, model_dir: str | Path) -> None:
    """The checks that need the model's config.json: every instance's tp must split the model's
    heads, expert widths and vocabulary evenly, and the DFlash draft (if on) must fit the model
    and split by every tp too (ConfigError naming the key and the model or draft field)."""
    from glm53.models.config import ConfigError as ModelConfigError
    from glm53.models.config import GlmConfig
    from glm53.models.draft_config import DFlashConfig, check_draft_tp
    from glm53.models.parallel import check_tp

    model = GlmConfig.from_dir(model_dir)
    draft = None
    if cfg.speculative.enabled:
        path = cfg.speculative.draft_model_path
        try:
            draft = DFlashConfig.from_dir(path, model)
        except (ModelConfigError, OSError) as e:
            raise ConfigError(cfg.source, "speculative.draft_model_path", f"{path}: {e}") from None
        n = cfg.speculative.num_draft_tokens
        if n is not None and n > draft.block_size:
            raise ConfigError(cfg.source, "speculative.num_draft_tokens",
                              f"{n} is larger than the draft's block size {draft.block_size}")
    for role in ROLES:
        for i, inst in enumerate(cfg.pool(role)):
            if inst.pp > model.num_hidden_layers:
                raise ConfigError(cfg.source, f"{role}[{i}].pp", f"{inst.pp} stages for a model of "
                                  f"{model.num_hidden_layers} layers (model {model_dir})")
            try:
                check_tp(model, inst.tp)
                if draft is not None:
                    check_draft_tp(draft, inst.tp)
            except ModelConfigError as e:
                raise ConfigError(cfg.source, f"{role}[{i}].tp", f"{e} (model {model_dir})") from None
