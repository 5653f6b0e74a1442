"""Instances that span nodes, without starting any: how ranks split over nodes (stage-major), the
config's `nodes` / `dist_init_addr` checks (each error names its key), the CLI's --nnodes /
--node-rank / --dist-init-addr, what `up --node-rank K` runs, each rank's GPU and transfer host,
and the rendezvous generations a rebuilt group meets under."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from glm53.server.cli import build_parser, overrides_from_args
from glm53.server.cli_nodes import check_instance_flags, node_role
from glm53.server.config import ConfigError
from glm53.server.config_parse import load_config, parse_config
from glm53.server.engine.processes import GENERATION_FROM_STORE, GENERATION_KEY, generation_store
from glm53.server.engine.worker import rank_specs
from glm53.server.nodes import node_of_rank, node_ranks, parse_host_port, ranks_per_node
from tests.server.config_files import error, write

H0, H1 = "10.0.0.1", "10.0.0.2"


def test_ranks_split_evenly_and_stage_major():
    # pp=2, tp=1 on two nodes: one stage each.
    assert [node_ranks(2, 2, k) for k in range(2)] == [range(0, 1), range(1, 2)]
    # pp=2, tp=4 on four nodes: ranks are pp-major, so stage 0 (ranks 0-3) is nodes 0 and 1.
    assert [list(node_ranks(8, 4, k)) for k in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [node_of_rank(8, 4, r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # pp=1, tp=16 on two nodes: the TP group is cut in half.
    assert ranks_per_node(16, 2) == 8 and node_of_rank(16, 2, 8) == 1
    with pytest.raises(ValueError, match="do not divide"):
        ranks_per_node(6, 4)
    with pytest.raises(ValueError, match="out of range"):
        node_ranks(4, 2, 2)
    assert parse_host_port("node0.example:29500") == ("node0.example", 29500)
    assert parse_host_port("[fe80::1]:29500") == ("fe80::1", 29500)
    for bad in ("node0", "node0:", ":29500", "node0:port", "node0:70000"):
        with pytest.raises(ValueError):
            parse_host_port(bad)


def two_nodes(**prefill) -> dict:
    return {
        "model": {"path": "/models/x"},
        "router": {"host": H0, "port": 30000, "result_port": 30001},
        "prefill": [{"name": "p0", "port": 40100, "bootstrap_port": 40101, "pp": 2,
                     "nodes": [{"host": H0}, {"host": H1}], "dist_init_addr": f"{H0}:29500", **prefill}],
        "decode": [{"name": "d0", "host": H0, "port": 40200}],
    }


def test_a_two_node_instance_parses_and_round_trips(tmp_path):
    cfg = load_config(write(tmp_path, two_nodes()))
    p0 = cfg.prefill[0]
    assert p0.host == H0 and [n.host for n in p0.nodes] == [H0, H1] and p0.rendezvous == (H0, 29500)
    assert not cfg.single_host
    assert [list(p0.node_ranks(k)) for k in range(2)] == [[0], [1]]
    assert parse_config(cfg.to_dict()).to_dict() == cfg.to_dict()
    # GPUs per node: each node lists its own, and two nodes may use the same ids.
    gpu = two_nodes(tp=2, device="cuda", nodes=[{"host": H0, "devices": [0, 1]}, {"host": H1, "devices": [0, 1]}])
    p0 = load_config(write(tmp_path, gpu)).prefill[0]
    assert [p0.rank_device(r) for r in range(4)] == [0, 1, 0, 1]
    assert [p0.rank_node(r).host for r in range(4)] == [H0, H0, H1, H1]


@pytest.mark.parametrize("change, key, words", [
    ({"pp": 3}, "prefill[0].nodes", "2 nodes do not divide pp × tp = 3 ranks evenly"),
    ({"dist_init_addr": None}, "prefill[0].dist_init_addr", "required"),
    ({"dist_init_addr": "10.0.0.1"}, "prefill[0].dist_init_addr", "HOST:PORT"),
    ({"host": H1}, "prefill[0].host", "node 0's host"),
    ({"devices": []}, "prefill[0].devices", "each node lists its own GPUs"),
    ({"dist_init_port": 29501}, "prefill[0].dist_init_port", "dist_init_addr"),
    ({"nodes": [{"host": H0}, {"host": H0}]}, "prefill[0].nodes[1].host", "already node 0"),
    ({"nodes": [{"host": H0}, {"host": H1, "devices": [0]}]}, "prefill[0].nodes[1].devices", "cpu"),
    ({"nodes": [{"host": H0}, {"host": H1, "gpus": [0]}]}, "prefill[0].nodes[1].gpus", "unknown key"),
    ({"nodes": []}, "prefill[0].nodes", "non-empty list"),
    ({"dist_init_addr": f"{H0}:40100"}, "prefill[0].dist_init_addr", "already used by prefill[0].port"),
    ({"port": None}, "prefill[0].port", "spans several hosts"),
])
def test_config_errors_name_the_key(tmp_path, change, key, words):
    d = two_nodes()
    for k, v in change.items():
        if v is None:
            del d["prefill"][0][k]
        else:
            d["prefill"][0][k] = v
    e = error(tmp_path, d)
    assert e.key == key and words in e.message, e


def test_gpu_and_placement_errors_name_the_key(tmp_path):
    d = two_nodes(tp=2, device="cuda", nodes=[{"host": H0, "devices": [0, 1]}, {"host": H1, "devices": [0]}])
    e = error(tmp_path, d)
    assert e.key == "prefill[0].nodes[1].devices" and "tp * pp / len(nodes) = 2 * 2 / 2 = 2" in e.message
    d = two_nodes()
    del d["prefill"][0]["nodes"]
    d["prefill"][0]["host"] = H0
    e = error(tmp_path, d)  # an instance on one host rendezvouses on dist_init_port
    assert e.key == "prefill[0].dist_init_addr" and "dist_init_port" in e.message
    d = two_nodes(colocate="d0")
    assert error(tmp_path, d).key == "prefill[0].colocate"


def test_rank_specs_give_each_rank_its_node_gpu_and_host(tmp_path):
    d = two_nodes(tp=2, device="cuda", nodes=[{"host": H0, "devices": [2, 3]}, {"host": H1, "devices": [0, 1]}])
    cfg = load_config(write(tmp_path, d))
    specs = rank_specs(cfg, cfg.prefill[0], "/models/x", num_layers=6)
    assert [(s.pp_rank, s.tp_rank, s.device, s.transport.host) for s in specs] == [
        (0, 0, "cuda:2", H0), (0, 1, "cuda:3", H0), (1, 0, "cuda:0", H1), (1, 1, "cuda:1", H1)]
    assert [s.layers for s in specs] == [range(0, 3)] * 2 + [range(3, 6)] * 2
    # An instance on one host keeps `devices` in rank order and its host.
    (dec,) = rank_specs(cfg, cfg.decode[0], "/models/x", num_layers=6)
    assert dec.transport.host == H0


def load_with_flags(tmp_path, d, argv):
    args = build_parser().parse_args(["prefill", "--config", str(write(tmp_path, d)), *argv])
    cfg = load_config(args.config, overrides_from_args(args, "prefill", 0))
    return cfg, args


def test_sglang_node_flags(tmp_path):
    d = two_nodes()
    del d["prefill"][0]["nodes"], d["prefill"][0]["dist_init_addr"]
    d["prefill"][0]["host"] = H0
    cfg, args = load_with_flags(tmp_path, d, ["--nnodes", "2", "--node-rank", "1", "--host", H1,
                                              "--dist-init-addr", f"{H0}:29600"])
    p0 = cfg.prefill[0]
    assert [n.host for n in p0.nodes] == [H0, H1] and p0.host == H0 and p0.dist_init_addr == f"{H0}:29600"
    assert check_instance_flags(cfg, p0, args) == 1
    # Node 0's --host is the instance's (and node 0's) address.
    cfg, args = load_with_flags(tmp_path, d, ["--nnodes", "2", "--node-rank", "0", "--host", "10.0.0.9",
                                              "--dist-init-addr", "10.0.0.9:29600"])
    assert cfg.prefill[0].host == cfg.prefill[0].nodes[0].host == "10.0.0.9"
    # Flags that contradict the YAML's nodes name the flag.
    cfg, args = load_with_flags(tmp_path, two_nodes(), ["--nnodes", "3"])
    with pytest.raises(ConfigError) as e:
        check_instance_flags(cfg, cfg.prefill[0], args)
    assert e.value.key == "--nnodes"
    cfg, args = load_with_flags(tmp_path, two_nodes(), ["--node-rank", "2"])
    with pytest.raises(ConfigError) as e:
        check_instance_flags(cfg, cfg.prefill[0], args)
    assert e.value.key == "--node-rank"


def test_what_up_runs_on_each_node(tmp_path):
    cfg = load_config(write(tmp_path, two_nodes()))
    zero = node_role(cfg, 0)
    assert zero.run_router and [i.name for i in zero.local] == ["p0", "d0"] and not zero.parts
    one = node_role(cfg, 1)
    assert not one.run_router and not one.local and [(p.name, p.node) for p in one.parts] == [("p0@node1", 1)]
    with pytest.raises(ConfigError) as e:
        node_role(cfg, 2)
    assert e.value.key == "--node-rank" and "p0 (2 nodes)" in e.value.message


def test_followers_join_the_generation_rank_0_published():
    """Node 0 keeps one store for every group it forms; a rank of another node reads the current
    generation and arrives under it only, so a rebuilt group never sees the last one's keys."""
    t = datetime.timedelta(seconds=5)
    master = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=t)
    client = dist.TCPStore("127.0.0.1", master.port, 2, is_master=False, timeout=t)
    for gen in (1, 2):
        assert master.add(GENERATION_KEY, 1) == gen
        view = dist.PrefixStore(f"glm53/g{gen}/", master)
        assert not view.check(["arrived/1"])  # what node 0 polls before it forms the group
        generation_store(client, GENERATION_FROM_STORE, rank=1)
        assert view.check(["arrived/1"])
    assert not dist.PrefixStore("glm53/g3/", master).check(["arrived/1"])
