import json
from pathlib import Path

import pytest

from glm53.server.cli import build_parser, overrides_from_args
from glm53.server.config import ConfigError
from glm53.server.config_parse import load_config, parse_config
from tests.server.config_files import error, write

ROOT = Path(__file__).resolve().parents[2]


def base() -> dict:
    return {
        "model": {"path": "/models/x"},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": 40100, "bootstrap_port": 40101}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": 40200}],
    }


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_are_valid(name):
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.prefill and cfg.decode
    # to_dict round-trips through the validator
    assert parse_config(cfg.to_dict()).to_dict() == cfg.to_dict()


def test_local_defaults():
    cfg = load_config(ROOT / "configs" / "local.yaml")
    assert cfg.router.port == 30000 and cfg.model.path == "embedded:tiny-glm5"
    assert cfg.single_host and cfg.prefill[0].engine.device == "cpu"
    assert cfg.prefill[0].engine.page_size == cfg.decode[0].engine.page_size


def test_defaults_inherited_and_overridden(tmp_path):
    d = base()
    d["defaults"] = {"page_size": 32, "max_running_requests": 8}
    d["decode"][0]["max_running_requests"] = 128
    cfg = load_config(write(tmp_path, d))
    assert cfg.prefill[0].engine.max_running_requests == 8
    assert cfg.decode[0].engine.max_running_requests == 128
    assert cfg.decode[0].engine.page_size == 32


def test_unknown_key(tmp_path):
    d = base()
    d["decode"][0]["max_runing_requests"] = 3
    e = error(tmp_path, d)
    assert e.key == "decode[0].max_runing_requests" and "did you mean 'max_running_requests'" in str(e)
    d = base()
    d["router"] = {"prot": 1}
    assert error(tmp_path, d).key == "router.prot"
    d = base()
    d["bogus"] = 1
    assert error(tmp_path, d).key == "bogus"


def test_wrong_type(tmp_path):
    d = base()
    d["router"] = {"port": "eighty"}
    e = error(tmp_path, d)
    assert e.key == "router.port" and "integer" in str(e)
    d = base()
    d["prefill"][0]["devices"] = "0,1"
    assert error(tmp_path, d).key == "prefill[0].devices"
    d = base()
    d["transfer"] = {"bootstrap_timeout_s": True}
    assert error(tmp_path, d).key == "transfer.bootstrap_timeout_s"
    d = base()
    d["router"] = {"policy": "fastest"}
    assert "round_robin" in str(error(tmp_path, d))
    d = base()
    d["decode"] = {"name": "d0"}
    assert error(tmp_path, d).key == "decode"


def test_topology(tmp_path):
    d = base()
    d["prefill"][0]["tp"] = 2
    d["decode"][0].update(tp=4, dist_init_port=40300)
    cfg = load_config(write(tmp_path, d))
    assert (cfg.prefill[0].tp, cfg.decode[0].tp, cfg.decode[0].engine.dist_init_port) == (2, 4, 40300)
    d["decode"][0]["dist_init_port"] = 40101  # p0's bootstrap port
    e = error(tmp_path, d)
    assert e.key == "decode[0].dist_init_port" and "prefill[0].bootstrap_port" in str(e)
    d = base()
    d["decode"][0]["dist_init_port"] = 40300  # one rank: nothing to rendezvous
    assert error(tmp_path, d).key == "decode[0].dist_init_port"
    d = base()
    d["prefill"][0]["tp"] = 0
    assert error(tmp_path, d).key == "prefill[0].tp"
    d = base()
    d["defaults"] = {"pp": 4}
    e = error(tmp_path, d)
    assert e.key == "decode[0].pp" and "one pipeline stage" in str(e)
    d = base()
    d["prefill"][0]["pp"] = 3
    assert load_config(write(tmp_path, d)).prefill[0].pp == 3
    d = base()
    d["decode"][0]["port"] = 40100  # same host and port as p0
    e = error(tmp_path, d)
    assert e.key == "decode[0].port" and "prefill[0].port" in str(e)
    d = base()
    d["decode"][0]["name"] = "p0"
    assert error(tmp_path, d).key == "decode[0].name"
    d = base()
    d["defaults"] = {"device": "cuda"}
    d["prefill"][0]["devices"] = [0]
    d["decode"][0]["devices"] = [0]
    e = error(tmp_path, d)
    assert e.key == "decode[0].devices" and "already used" in str(e)
    d = base()
    d["defaults"] = {"device": "cuda"}
    d["prefill"][0]["devices"] = [0, 1]
    d["decode"][0]["devices"] = [2]
    assert "tp * pp = 1" in str(error(tmp_path, d))
    d = base()
    d["decode"][0]["page_size"] = 32
    assert error(tmp_path, d).key == "decode[0].page_size"
    d = base()
    d["decode"] = []
    assert error(tmp_path, d).key == "decode"
    d = base()
    del d["prefill"][0]["host"]
    assert error(tmp_path, d).key == "prefill[0].host"


def test_internal_ports_are_optional_on_one_host(tmp_path):
    """Unpinned endpoints are ipc names derived from the HTTP address: every process of one
    server derives the same ones, two servers (two HTTP ports) never share one."""
    d = base()
    del d["prefill"][0]["port"], d["prefill"][0]["bootstrap_port"], d["decode"][0]["port"]
    cfg = load_config(write(tmp_path, d))
    p, dec = cfg.prefill[0], cfg.decode[0]
    assert cfg.router.result_port is None and p.port is None and p.bootstrap_port is None
    addrs = {cfg.router.result_address, p.address, p.bootstrap_address, dec.address}
    assert len(addrs) == 4 and all(a.startswith("ipc://@glm53-local-30000/") for a in addrs)
    assert cfg.router.result_bind_address == cfg.router.result_address and dec.bootstrap_address is None
    # the resolved form `up` writes for its processes derives the same names
    again = parse_config(cfg.to_dict())
    assert (again.prefill[0].bootstrap_address, again.decode[0].address) == (p.bootstrap_address, dec.address)
    other = load_config(write(tmp_path, {**d, "router": {"port": 31000}}))
    assert not addrs & {other.router.result_address, other.prefill[0].address, other.decode[0].address}
    # pinned ports are TCP as before
    cfg = load_config(write(tmp_path, base()))
    assert (cfg.prefill[0].address, cfg.prefill[0].bootstrap_address) == ("tcp://127.0.0.1:40100",
                                                                         "tcp://127.0.0.1:40101")
    # across hosts an ipc name reaches nobody: every internal port is required
    d = base()
    d["decode"][0]["host"] = "10.0.0.2"
    e = error(tmp_path, d)
    assert e.key == "router.result_port" and "several hosts" in str(e)
    d["router"] = {"result_port": 40001}
    del d["prefill"][0]["bootstrap_port"]
    assert error(tmp_path, d).key == "prefill[0].bootstrap_port"


def _one_gpu(prefill: dict, decode: dict, defaults: dict | None = None) -> dict:
    d = base()
    d["defaults"] = {"device": "cuda", **(defaults or {})}
    d["prefill"][0].update({"devices": [0], **prefill})
    d["decode"][0].update({"devices": [0], **decode})
    return d


def test_one_gpu_pd_with_explicit_memory_fractions(tmp_path):
    # prefill and decode on one GPU: allowed when each sets its share and the sum is <= 0.95
    cfg = load_config(write(tmp_path, _one_gpu({"mem_fraction_static": 0.45}, {"mem_fraction_static": 0.5})))
    assert cfg.prefill[0].devices == cfg.decode[0].devices == [0]
    assert (cfg.prefill[0].engine.mem_fraction_static, cfg.decode[0].engine.mem_fraction_static) == (0.45, 0.5)
    assert parse_config(cfg.to_dict()).to_dict() == cfg.to_dict()
    # set once in defaults counts as set for each instance (0.45 + 0.45)
    load_config(write(tmp_path, _one_gpu({}, {}, {"mem_fraction_static": 0.45})))
    # the sum is over every instance on the GPU: a second decode instance tips it over
    d = _one_gpu({"mem_fraction_static": 0.3}, {"mem_fraction_static": 0.3})
    d["decode"].append({"name": "d1", "host": "127.0.0.1", "port": 40202, "devices": [0], "mem_fraction_static": 0.4})
    e = error(tmp_path, d)
    assert e.key == "decode[1].devices" and "prefill[0], decode[0]" in str(e) and "= 1" in str(e)
    # tp instances may share all their GPUs
    d = _one_gpu({"mem_fraction_static": 0.4, "tp": 2, "devices": [0, 1]},
                 {"mem_fraction_static": 0.4, "tp": 2, "devices": [1, 0], "dist_init_port": 40300})
    load_config(write(tmp_path, d))
    # another host's GPU 0 is another GPU
    d = _one_gpu({}, {"host": "10.0.0.2"})
    d["router"] = {"result_port": 40001}  # two hosts: the internal ports are pinned
    load_config(write(tmp_path, d))


def test_one_gpu_pd_refused_without_fractions_or_over_095(tmp_path):
    e = error(tmp_path, _one_gpu({"mem_fraction_static": 0.6}, {"mem_fraction_static": 0.5}))
    assert e.key == "decode[0].devices"
    assert str(e).endswith("decode[0].devices: GPU 0 on host 127.0.0.1 is shared with prefill[0]; their "
                           "mem_fraction_static must be set and sum to at most 0.95 (prefill[0].mem_fraction_static "
                           "0.6 + decode[0].mem_fraction_static 0.5 = 1.1)"), str(e)
    # one side left at the default (0.85): refused, naming both instances' keys
    e = error(tmp_path, _one_gpu({}, {"mem_fraction_static": 0.1}))
    assert e.key == "decode[0].devices" and "already used by prefill[0]" in str(e)
    assert "not set: prefill[0]" in str(e)
    assert "prefill[0].mem_fraction_static and decode[0].mem_fraction_static" in str(e)
    # written out at the default value is explicit, and 0.85 + 0.1 = 0.95 fits
    load_config(write(tmp_path, _one_gpu({"mem_fraction_static": 0.85}, {"mem_fraction_static": 0.1})))
    # the CLI flag sets it everywhere: 2 x 0.5 is too much, 2 x 0.45 is fine
    p = write(tmp_path, _one_gpu({}, {}))
    args = build_parser().parse_args(["up", "--config", str(p), "--mem-fraction-static", "0.5"])
    with pytest.raises(ConfigError) as ex:
        load_config(p, overrides_from_args(args))
    assert ex.value.key == "decode[0].devices" and "= 1)" in str(ex.value)
    args = build_parser().parse_args(["up", "--config", str(p), "--gpu-memory-utilization", "0.45"])
    assert load_config(p, overrides_from_args(args)).decode[0].engine.mem_fraction_static == 0.45
    # one instance still may not list a GPU twice, whatever its fraction
    d = _one_gpu({"mem_fraction_static": 0.3, "tp": 2, "devices": [0, 0]}, {"mem_fraction_static": 0.3})
    assert "lists a GPU twice" in str(error(tmp_path, d))


def test_colocated_pair(tmp_path):
    """prefill[i].colocate names the decode instance whose process and GPU it shares."""
    fr = {"mem_fraction_static": 0.45}
    cfg = load_config(write(tmp_path, _one_gpu({**fr, "colocate": "d0", "colocate_sms": 40}, fr)))
    assert (cfg.prefill[0].colocate, cfg.prefill[0].colocate_sms, cfg.decode[0].colocate) == ("d0", 40, None)
    assert parse_config(cfg.to_dict()).to_dict() == cfg.to_dict()
    assert "colocate" not in cfg.to_dict()["decode"][0]
    cases = [
        (_one_gpu({**fr, "colocate": "d9"}, fr), "prefill[0].colocate", "no decode instance named 'd9' (have: d0)"),
        (_one_gpu({**fr, "colocate": "d0", "colocate_sms": 0}, fr), "prefill[0].colocate_sms", "must be >= 1"),
        (_one_gpu({**fr, "colocate": "d0", "devices": [1]}, fr), "prefill[0].colocate", "share one process and GPU"),
        (_one_gpu({**fr, "colocate": "d0", "tp": 2, "devices": [0, 1]}, fr), "prefill[0].colocate", "tp 1, pp 1"),
        (_one_gpu(fr, {**fr, "colocate": "p0"}), "decode[0].colocate", "set on the prefill instance"),
        (_one_gpu({**fr, "colocate": "d0", "device": "cpu", "devices": []}, fr), "prefill[0].colocate",
         "prefill device 'cpu', decode d0 device 'cuda'"),
    ]
    two = _one_gpu({"mem_fraction_static": 0.3, "colocate": "d0"}, {"mem_fraction_static": 0.3})
    two["prefill"].append({"name": "p1", "host": "127.0.0.1", "port": 40110, "bootstrap_port": 40111,
                           "devices": [0], "mem_fraction_static": 0.3, "colocate": "d0"})
    cases.append((two, "prefill[1].colocate", "already shares its process with prefill[0]"))
    for d, key, msg in cases:
        e = error(tmp_path, d)
        assert e.key == key and msg in str(e), (key, str(e))
    # on CPU a pair shares the process only
    load_config(write(tmp_path, {**base(), "prefill": [{**base()["prefill"][0], "colocate": "d0"}]}))
    # the pair still states its memory shares, as any two instances on one GPU
    e = error(tmp_path, _one_gpu({"colocate": "d0"}, {}))
    assert e.key == "decode[0].devices"


def test_colocated_prefill_runs_in_its_decode_process():
    from glm53.server.cli_up import process_name
    from glm53.server.engine.prefill import main as prefill_main

    cfg = parse_config(_one_gpu({"mem_fraction_static": 0.4, "colocate": "d0"}, {"mem_fraction_static": 0.4}))
    assert [process_name(i) for i in cfg.instances] == ["d0", "d0"]
    with pytest.raises(SystemExit, match="runs in decode instance d0's process"):
        prefill_main(cfg, 0)


def test_yaml_syntax_and_missing_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and "YAML" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(e.value)


def test_cli_flags_override_yaml(tmp_path):
    d = base()
    d["decode"][0]["page_size"] = 16
    d["prefill"][0]["page_size"] = 16
    p = write(tmp_path, d)
    args = build_parser().parse_args(["up", "--config", str(p), "--page-size", "64", "--max-num-seqs", "7",
                                      "--port", "31234", "--model", str(tmp_path)])
    cfg = load_config(p, overrides_from_args(args))
    assert cfg.router.port == 31234 and cfg.model.path == str(tmp_path)
    assert all(i.engine.page_size == 64 and i.engine.max_running_requests == 7 for i in cfg.instances)
    args = build_parser().parse_args(["up", "--config", str(p), "-tp", "2"])
    assert {i.tp for i in load_config(p, overrides_from_args(args)).instances} == {2}
    args = build_parser().parse_args(["up", "--config", str(p), "--pp-size", "2"])
    with pytest.raises(ConfigError) as e:
        load_config(p, overrides_from_args(args))
    assert e.value.key == "decode[0].pp" and "one pipeline stage" in str(e.value)
    args = build_parser().parse_args(["prefill", "--config", str(p), "--port", "41000",
                                      "--disaggregation-bootstrap-port", "41001"])
    cfg = load_config(p, overrides_from_args(args, "prefill", 0))
    assert (cfg.prefill[0].port, cfg.prefill[0].bootstrap_port) == (41000, 41001)
    # Decode instances have no bootstrap server: the flag is refused, naming the key.
    args = build_parser().parse_args(["decode", "--config", str(p), "--disaggregation-bootstrap-port", "41002"])
    with pytest.raises(ConfigError) as e:
        load_config(p, overrides_from_args(args, "decode", 0))
    assert e.value.key == "decode[0].bootstrap_port"
    assert cfg.router.port == 30000


def test_kv_cache_dtype(tmp_path):
    d = base()
    d["defaults"] = {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"}
    assert all(i.engine.kv_cache_dtype == "fp8_e4m3" for i in load_config(write(tmp_path, d)).instances)
    d = base()
    d["defaults"] = {"dtype": "bfloat16", "kv_cache_dtype": "float32"}  # a 16/32-bit cache != the model's
    e = error(tmp_path, d)
    assert e.key == "defaults.kv_cache_dtype" and "fp8_e4m3" in str(e)
    # Prefill and decode must agree: the error names both keys.
    d = base()
    d["decode"][0]["kv_cache_dtype"] = "fp8_e4m3"
    e = error(tmp_path, d)
    assert e.key == "decode[0].kv_cache_dtype" and "prefill[0].kv_cache_dtype" in str(e)
    # The flag, like every engine flag, sets it for every instance of the file.
    p = write(tmp_path, base())
    args = build_parser().parse_args(["decode", "--config", str(p), "--kv-cache-dtype", "fp8_e4m3"])
    cfg = load_config(p, overrides_from_args(args, "decode", 0))
    assert {i.engine.kv_cache_dtype for i in cfg.instances} == {"fp8_e4m3"}


def test_fp8_kv_must_fit_the_model(tmp_path, model_dir):
    import json
    import shutil

    from glm53.server.model_fit import check_model_fit

    d = base()
    d["defaults"] = {"kv_cache_dtype": "fp8_e4m3"}
    check_model_fit(load_config(write(tmp_path, d)), model_dir)  # kv_lora_rank 96, rope 32, keys 64
    odd = tmp_path / "odd"
    shutil.copytree(model_dir, odd)
    c = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**c, "kv_lora_rank": 98}))
    with pytest.raises(ConfigError) as e:
        check_model_fit(load_config(write(tmp_path, d)), odd)
    assert e.value.key == "prefill[0].kv_cache_dtype" and "kv_lora_rank" in str(e.value)


def test_engine_keys_that_are_not_built_yet_are_refused(tmp_path):
    d = base()
    d["defaults"] = {"dist_init_port": 40300}  # one-rank instances have nothing to rendezvous
    assert error(tmp_path, d).key == "prefill[0].dist_init_port"
    d = base()
    d["transfer"] = {"backend": "fake"}
    assert error(tmp_path, d).key == "transfer.backend"
    d = base()
    d["defaults"] = {"dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}
    assert load_config(write(tmp_path, d)).decode[0].engine.kv_cache_dtype == "bfloat16"


def test_kv_capacity_from_num_pages_or_tokens(tmp_path):
    import torch

    from glm53.models import GlmConfig
    from glm53.server.engine.worker import kv_pages, rank_specs
    from tests.models.glm5_config import GLM5

    cfg = GlmConfig.from_dict(GLM5)

    def rank(defaults):
        d = base()
        d["defaults"] = defaults
        cluster = load_config(write(tmp_path, d))
        return rank_specs(cluster, cluster.decode[0], "unused", cfg.num_hidden_layers)[0]

    assert kv_pages(rank({"page_size": 64, "num_pages": 10}), cfg, torch.bfloat16) == 10
    assert kv_pages(rank({"page_size": 64, "max_total_tokens": 1000}), cfg, torch.bfloat16) == 16
    # GLM-5 in bf16: 78 latent layers x 576 + 78 indexer layers x 128 values per token.
    from glm53.models import ModelRunner

    assert ModelRunner.kv_bytes_per_token(cfg, torch.bfloat16) == (78 * 576 + 78 * 128) * 2
    # FP8: the 656 B latent row and the 132 B indexer key, per layer; pages that fit the budget
    # follow (kv_pages divides the budget by this).
    assert ModelRunner.kv_bytes_per_token(cfg, torch.bfloat16, kv_dtype=torch.float8_e4m3fn) == 78 * (656 + 132)


def test_ep_must_divide_tp(tmp_path):
    d = base()
    d["prefill"][0].update(tp=4, ep=2)
    d["decode"][0].update(tp=2, ep_size=2)  # SGLang's name is an alias
    cfg = load_config(write(tmp_path, d))
    assert [(i.tp, i.ep) for i in cfg.instances] == [(4, 2), (2, 2)]
    assert load_config(write(tmp_path, cfg.to_dict())).decode[0].ep == 2  # round-trips
    d["decode"][0]["ep_size"] = 3
    e = error(tmp_path, d)
    assert e.key == "decode[0].ep" and "must divide tp (2)" in str(e) and "got 3" in str(e)
    d = base()
    d["defaults"] = {"ep": 0}
    assert error(tmp_path, d).key == "prefill[0].ep"
    # --ep-size (SGLang; --ep, --expert-parallel-size) sets every instance, like --tp-size.
    p = write(tmp_path, base())
    args = build_parser().parse_args(["up", "--config", str(p), "--tp-size", "2", "--ep-size", "2"])
    assert {(i.tp, i.ep) for i in load_config(p, overrides_from_args(args)).instances} == {(2, 2)}
    args = build_parser().parse_args(["up", "--config", str(p), "--expert-parallel-size", "2"])
    with pytest.raises(ConfigError) as e:
        load_config(p, overrides_from_args(args))
    assert e.value.key == "prefill[0].ep" and "must divide tp (1)" in str(e.value)


def test_tp_must_split_the_model(tmp_path, model_dir):
    from glm53.server.model_fit import check_model_fit

    d = base()
    d["decode"][0]["tp"] = 2
    check_model_fit(load_config(write(tmp_path, d)), model_dir)  # 4 heads, widths and vocab split by 2
    d["decode"][0]["tp"] = 3
    cfg = load_config(write(tmp_path, d))
    with pytest.raises(ConfigError) as e:
        check_model_fit(cfg, model_dir)
    assert e.value.key == "decode[0].tp" and "num_attention_heads" in str(e.value) and "3" in str(e.value)


def test_the_draft_must_fit_the_model(tmp_path, model_dir):
    import json

    from glm53.models import write_random_draft
    from glm53.server.model_fit import check_model_fit

    draft = write_random_draft(tmp_path / "draft", model_dir, n_layers=1, block_size=4)
    d = base()
    d["speculative"] = {"algorithm": "DFLASH", "draft_model_path": str(draft)}
    check_model_fit(load_config(write(tmp_path, d)), model_dir)
    d["speculative"]["num_draft_tokens"] = 8
    with pytest.raises(ConfigError) as e:
        check_model_fit(load_config(write(tmp_path, d)), model_dir)
    assert e.value.key == "speculative.num_draft_tokens" and "block size 4" in str(e.value)
    del d["speculative"]["num_draft_tokens"]
    cfg_path = draft / "config.json"
    c = json.loads(cfg_path.read_text())
    c["hidden_size"] = 128
    cfg_path.write_text(json.dumps(c))
    with pytest.raises(ConfigError) as e:
        check_model_fit(load_config(write(tmp_path, d)), model_dir)
    assert e.value.key == "speculative.draft_model_path" and "hidden_size" in str(e.value)
    d = base()
    d["speculative"] = {"algorithm": "DFLASH"}
    assert error(tmp_path, d).key == "speculative.draft_model_path"


def test_embedded_draft_names(tmp_path):
    d = base()
    d["model"] = {"path": "embedded:tiny-glm5"}
    d["speculative"] = {"algorithm": "DFLASH", "draft_model_path": "embedded:tiny-glm5-dflash"}
    assert load_config(write(tmp_path, d)).speculative.draft_model_path == "embedded:tiny-glm5-dflash"
    d["speculative"] = {"algorithm": "DSPARK", "draft_model_path": "embedded:tiny-glm5-dspark"}
    assert load_config(write(tmp_path, d)).speculative.draft_model_path == "embedded:tiny-glm5-dspark"
    d["speculative"]["draft_model_path"] = "embedded:nope"
    assert "unknown embedded draft" in str(error(tmp_path, d))
    d["model"] = {"path": "embedded:tiny-glm5-random"}
    d["speculative"]["draft_model_path"] = "embedded:tiny-glm5-dflash"
    e = error(tmp_path, d)
    assert e.key == "speculative.draft_model_path" and "tiny-glm5-random" in str(e)


def test_router_limits_and_restart_keys(tmp_path):
    cfg = parse_config(base())
    assert cfg.router.max_request_bytes == 4 << 20 and cfg.router.max_restarts == 5
    for key, bad in (("max_request_bytes", 10), ("tokenizer_pool_size", 0), ("max_restarts", -1),
                     ("restart_window_s", 0), ("restart_backoff_s", -1.0)):
        d = base()
        d["router"] = {key: bad}
        assert error(tmp_path, d).key == f"router.{key}"


def test_cuda_graph_keys(tmp_path):
    from glm53.server.engine.worker import rank_specs

    d = base()
    d["defaults"] = {"device": "cuda", "dtype": "bfloat16"}
    d["prefill"][0]["devices"] = [0]
    d["decode"][0].update(devices=[1], max_running_requests=48)
    cluster = load_config(write(tmp_path, d))
    spec = rank_specs(cluster, cluster.decode[0], "unused", 4)[0]
    # on by default for a one-rank CUDA decode instance, capped at its batch
    assert spec.graphs and spec.cuda_graph_max_bs == 48
    assert not rank_specs(cluster, cluster.prefill[0], "unused", 4)[0].graphs
    d["decode"][0]["disable_cuda_graph"] = True
    cluster = load_config(write(tmp_path, d))
    assert not rank_specs(cluster, cluster.decode[0], "unused", 4)[0].graphs
    d["decode"][0]["cuda_graph_max_bs"] = 0
    e = error(tmp_path, d)
    assert e.key == "decode[0].cuda_graph_max_bs" and "must be >= 1" in str(e)
    args = build_parser().parse_args(["up", "--config", str(write(tmp_path, base())), "--cuda-graph-max-bs", "8",
                                      "--disable-cuda-graph"])
    cfg = load_config(write(tmp_path, base()), overrides_from_args(args))
    assert all(i.engine.cuda_graph_max_bs == 8 and i.engine.disable_cuda_graph for i in cfg.instances)


def test_dspark_keys_and_flags(tmp_path):
    d = base()
    d["speculative"] = {"algorithm": "DSPARK", "draft_model_path": "/x", "dspark_block_size": 6,
                        "dspark_confidence_threshold": 0.4}
    spec = load_config(write(tmp_path, d)).speculative
    assert spec.enabled and spec.verify_width == 6 and spec.dspark_confidence_threshold == 0.4
    for change, key in ((dict(dspark_block_size=1), "speculative.dspark_block_size"),
                        (dict(dspark_confidence_threshold=1.0), "speculative.dspark_confidence_threshold"),
                        (dict(dspark_confidence_threshold=-0.1), "speculative.dspark_confidence_threshold"),
                        (dict(dspark_confidence_threshold="high"), "speculative.dspark_confidence_threshold"),
                        (dict(num_draft_tokens=4), "speculative.dspark_block_size"),
                        (dict(algorithm="DFLASH"), "speculative.dspark_block_size"),
                        (dict(algorithm="MEDUSA"), "speculative.algorithm")):
        bad = base()
        bad["speculative"] = {**d["speculative"], **change}
        assert error(tmp_path, bad).key == key, change
    p = write(tmp_path, base())
    args = build_parser().parse_args(["up", "--config", str(p), "--speculative-algorithm", "dspark",
                                      "--speculative-draft-model-path", "/x", "--speculative-dspark-block-size", "5",
                                      "--speculative-dspark-confidence-threshold", "0.25"])
    spec = load_config(p, overrides_from_args(args)).speculative
    assert (spec.algorithm, spec.verify_width, spec.dspark_confidence_threshold) == ("DSPARK", 5, 0.25)


def test_disable_by_batch_size_key_and_flag(tmp_path):
    d = base()
    d["speculative"] = {"algorithm": "DFLASH", "draft_model_path": "/x", "disable_by_batch_size": 8}
    assert load_config(write(tmp_path, d)).speculative.disable_by_batch_size == 8
    for change in (dict(disable_by_batch_size=0), dict(disable_by_batch_size="many"),
                   dict(algorithm="NEXTN", draft_model_path=None)):
        bad = base()
        bad["speculative"] = {**d["speculative"], **change}
        assert error(tmp_path, bad).key == "speculative.disable_by_batch_size", change
    p = write(tmp_path, base())
    args = build_parser().parse_args(["up", "--config", str(p), "--speculative-algorithm", "dspark",
                                      "--speculative-draft-model-path", "/x", "--speculative-disable-by-batch-size", "4"])
    assert load_config(p, overrides_from_args(args)).speculative.disable_by_batch_size == 4


def test_speculation_off_ignores_the_keys_of_an_algorithm(tmp_path):
    # `--speculative-algorithm none` on a config written for DSPARK or NEXTN (the shipped
    # configs/local.yaml is a DSPARK one): its algorithm's keys are ignored, like its draft
    for spec in ({"algorithm": "DSPARK", "draft_model_path": "/x", "dspark_block_size": 16,
                  "dspark_confidence_threshold": 0.2},
                 {"algorithm": "NEXTN", "num_steps": 3, "eagle_topk": 1}):
        d = base()
        d["speculative"] = spec
        p = write(tmp_path, d)
        args = build_parser().parse_args(["up", "--config", str(p), "--speculative-algorithm", "none"])
        off = load_config(p, overrides_from_args(args)).speculative
        assert off.algorithm == "none" and not off.enabled and not off.nextn, spec
    d["speculative"] = {"algorithm": "DFLASH", "draft_model_path": "/x", "num_steps": 3}
    assert error(tmp_path, d).key == "speculative.num_steps"  # still refused with speculation on


def test_draft_family_is_checked_against_the_checkpoint_before_start(tmp_path, capsys):
    # model_fit reads the draft's config.json and its heads' tensor names: the algorithm asked for,
    # the verify width and a confidence cut are refused at config time, naming the key
    from glm53.server.cli import main

    assets = ROOT / "assets"

    def config(**spec) -> str:
        d = {"model": {"path": str(assets / "tiny-glm5")}, "router": {"port": 0},
             "prefill": [{"name": "p0", "host": "127.0.0.1"}], "decode": [{"name": "d0", "host": "127.0.0.1"}],
             "speculative": spec}
        return str(write(tmp_path, d))

    dflash, dspark = str(assets / "tiny-glm5-dflash"), str(assets / "tiny-glm5-dspark")
    assert main(["config", "--config", config(algorithm="DSPARK", draft_model_path=dspark,
                                              dspark_confidence_threshold=0.2)]) == 0
    assert main(["config", "--config", config(algorithm="DFLASH", draft_model_path=dflash)]) == 0
    capsys.readouterr()
    for spec, key in ((dict(algorithm="DSPARK", draft_model_path=dflash), "speculative.algorithm"),
                      (dict(algorithm="DFLASH", draft_model_path=dspark), "speculative.algorithm"),
                      (dict(algorithm="DSPARK", draft_model_path=dspark, dspark_block_size=17),
                       "speculative.dspark_block_size"),
                      (dict(algorithm="DFLASH", draft_model_path=dflash, num_draft_tokens=17),
                       "speculative.num_draft_tokens")):
        assert main(["config", "--config", config(**spec)]) == 2, spec
        err = capsys.readouterr().err
        assert f": {key}: " in err and len(err.strip().splitlines()) == 1, (spec, err)


def test_nextn_keys_and_flags(tmp_path, capsys):
    # NEXTN (alias EAGLE): the model's own MTP layer; num_steps, topk 1, num_draft_tokens = steps + 1;
    # a checkpoint without the layer is refused by model_fit before start-up, naming it
    from glm53.server.cli import main

    d = base()
    d["speculative"] = {"algorithm": "NEXTN", "num_steps": 2}
    spec = load_config(write(tmp_path, d)).speculative
    assert spec.nextn and not spec.enabled and spec.verify_width == 3
    d["speculative"] = {"algorithm": "EAGLE"}
    assert load_config(write(tmp_path, d)).speculative.verify_width == 4
    for change, key in ((dict(draft_model_path="/x"), "speculative.draft_model_path"),
                        (dict(eagle_topk=2), "speculative.eagle_topk"),
                        (dict(num_steps=0), "speculative.num_steps"),
                        (dict(num_steps=3, num_draft_tokens=6), "speculative.num_draft_tokens"),
                        (dict(algorithm="DFLASH", draft_model_path="/x", num_steps=3), "speculative.num_steps")):
        bad = base()
        bad["speculative"] = {"algorithm": "EAGLE", **change}
        assert error(tmp_path, bad).key == key, change
    p = write(tmp_path, base())
    args = build_parser().parse_args(["up", "--config", str(p), "--speculative-algorithm", "nextn",
                                      "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                                      "--speculative-num-draft-tokens", "4"])
    spec = load_config(p, overrides_from_args(args)).speculative
    assert (spec.algorithm, spec.num_steps, spec.eagle_topk, spec.verify_width) == ("NEXTN", 3, 1, 4)
    plain = {"model": {"path": str(ROOT / "assets" / "tiny-glm5")}, "router": {"port": 0},
             "prefill": [{"name": "p0", "host": "127.0.0.1"}], "decode": [{"name": "d0", "host": "127.0.0.1"}],
             "speculative": {"algorithm": "NEXTN"}}
    from glm53.models import GlmConfig
    if GlmConfig.from_dir(ROOT / "assets" / "tiny-glm5").num_nextn_predict_layers:  # the shipped layer
        assert main(["config", "--config", str(write(tmp_path, plain))]) == 0
    no_layer = tmp_path / "no-mtp"
    no_layer.mkdir()
    cfg = json.loads((ROOT / "assets" / "tiny-glm5" / "config.json").read_text())
    (no_layer / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    plain["model"]["path"] = str(no_layer)
    assert main(["config", "--config", str(write(tmp_path, plain))]) != 0
    err = capsys.readouterr().err
    assert "speculative.algorithm" in err and "num_nextn_predict_layers" in err, err
