import json

import pytest

from glm53.models.config import ConfigError, GlmConfig, indexer_schedule, indexer_source_layers
from tests.models.glm5_config import GLM5


def test_glm5_defaults_every_layer_full():
    cfg = GlmConfig.from_dict(GLM5)
    assert cfg.full_layers == list(range(78))
    assert cfg.qk_head_dim == 256 and cfg.softmax_scale == 1 / 16
    assert cfg.latent_dim == 576
    assert [cfg.is_moe(i) for i in range(4)] == [False, False, False, True]
    assert cfg.eos_token_ids == (154820, 154827, 154829)


def test_glm52_freq4_offset3_schedule():
    cfg = GlmConfig.from_dict({**GLM5, "index_topk_freq": 4, "index_skip_topk_offset": 3,
                               "rope_parameters": {"rope_theta": 8_000_000, "rope_type": "default"}})
    assert cfg.full_layers == [0, 1, 2] + list(range(6, 78, 4))
    assert len(cfg.full_layers) == 21
    src = cfg.indexer_source
    assert src[3:6] == [2, 2, 2] and src[7:10] == [6, 6, 6] and src[75:78] == [74, 74, 74]
    # The 1-indexed formula fed 0-based ids gives the wrong set {0,1,2,3,7,...}: not ours.
    assert 3 not in cfg.full_layers and 6 in cfg.full_layers


def test_schedule_precedence_types_over_pattern_over_freq():
    types = ["full", "shared", "full", "shared"]
    assert indexer_schedule(4, indexer_types=types, pattern="FFFF", freq=2) == types
    assert indexer_schedule(4, pattern="FSSF", freq=1) == ["full", "shared", "shared", "full"]
    assert indexer_schedule(5, freq=2, offset=2) == ["full", "full", "shared", "full", "shared"]
    assert indexer_source_layers(["full", "shared", "full", "shared"]) == [0, 0, 2, 2]


def test_searched_indexcache_pattern():
    pattern = "FFSFSSSFSSFSFSSSSSSSFSSSSSSFSSSFSFSSSSFFFFFSSSFFSSSFSSSSSSSSFSSSFSSSSSSFSFSSSS"
    cfg = GlmConfig.from_dict({**GLM5, "index_topk_pattern": pattern})
    assert len(cfg.full_layers) == pattern.count("F") == 22


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"indexer_types": ["full"] * 77}, "indexer_types"),
        ({"indexer_types": ["shared"] + ["full"] * 77}, "indexer_types"),
        ({"index_topk_pattern": "FX" * 39}, "index_topk_pattern"),
        ({"index_topk_freq": 0}, "index_topk_freq"),
        ({"index_skip_topk_offset": -1}, "index_skip_topk_offset"),
        ({"hidden_size": "big"}, "hidden_size"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 2}, "topk_group"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4, "rope_theta": 1e4}}, "rope_parameters.rope_type"),
        ({"eos_token_id": [1, "x"]}, "eos_token_id"),
        ({"eos_token_id": 10**9}, "eos_token_id"),
        ({"model_type": "llama"}, "model_type"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ],
)
def test_invalid_values_name_the_field(patch, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        GlmConfig.from_dict({**GLM5, **patch})


def test_missing_field_and_file_are_named(tmp_path):
    d = dict(GLM5)
    del d["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=r"config\.json: kv_lora_rank: required"):
        GlmConfig.from_dir(tmp_path)
