"""How an instance is cut into ranks: stage layer ranges and the rank specs (pure)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from glm53.server.config_parse import parse_config
from glm53.server.engine.worker import rank_specs, stage_layers


@pytest.mark.parametrize("layers,pp", [(n, s) for n in range(1, 13) for s in range(1, n + 1)])
def test_stage_layers_cover_every_layer_once_in_order(layers, pp):
    stages = stage_layers(layers, pp)
    assert len(stages) == pp
    assert list(itertools.chain.from_iterable(stages)) == list(range(layers))
    sizes = [len(s) for s in stages]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_stage_layers_rejects_impossible_splits():
    for layers, pp in [(4, 0), (4, 5)]:
        with pytest.raises(ValueError, match="pp_size"):
            stage_layers(layers, pp)


def test_rank_specs_are_pp_major_with_their_stage_and_gpu():
    cluster = parse_config({
        "model": {"path": "/m"},
        "router": {"result_port": 5},  # the config spans hosts: every internal port is pinned
        "defaults": {"device": "cuda", "page_size": 32, "num_pages": 100},
        "prefill": [{"name": "p0", "host": "10.0.0.1", "port": 1, "bootstrap_port": 2, "devices": [4]}],
        "decode": [{"name": "d0", "host": "10.0.0.2", "port": 3, "devices": [0]}],
    })
    # tp/pp > 1 arrive with their own issues; the cut itself is already defined for them.
    inst = dataclasses.replace(cluster.prefill[0], tp=2, pp=3, devices=[7, 6, 5, 4, 3, 2])
    specs = rank_specs(cluster, inst, "/m", num_layers=8)
    assert [(s.pp_rank, s.tp_rank) for s in specs] == [(p, t) for p in range(3) for t in range(2)]
    assert [s.device for s in specs] == [f"cuda:{d}" for d in (7, 6, 5, 4, 3, 2)]
    assert [s.layers for s in specs] == [range(0, 3)] * 2 + [range(3, 6)] * 2 + [range(6, 8)] * 2
    assert [s.last_stage for s in specs] == [False] * 4 + [True] * 2
    assert {s.bootstrap_address for s in specs} == {"tcp://10.0.0.1:2"}
    assert {(s.tp_size, s.pp_size, s.page_size, s.num_pages, s.role) for s in specs} == {(2, 3, 32, 100, "prefill")}
    (d,) = rank_specs(cluster, cluster.decode[0], "/m", num_layers=8)
    assert d.bootstrap_address is None and d.layers == range(8) and d.device == "cuda:0"
