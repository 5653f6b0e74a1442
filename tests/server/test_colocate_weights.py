"""A colocated pair holds one copy of the weights: the prefill rank built beside a decode rank of
the same model reuses its modules, and prefills exactly as a rank that loaded its own."""

from __future__ import annotations

import pytest
import torch

from glm53.models import write_random_draft
from glm53.server.config_parse import parse_config
from glm53.server.engine.decode import DecodeScheduler
from glm53.server.engine.prefill import PrefillScheduler
from glm53.support.ports import free_ports
from tests.server.prefill_rooms import Sender, prefill


def _cfg(model_dir, prefill_dtype: str = "float32", speculative: dict | None = None):
    ports = free_ports(4)
    return parse_config({
        **({"speculative": speculative} if speculative else {}),
        "model": {"path": str(model_dir)},
        "defaults": {"device": "cpu", "dtype": "float32", "page_size": 16, "num_pages": 40, "chunked_prefill_size": 64},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1],
                     "colocate": "d0", "dtype": prefill_dtype}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2]}],
    })


def _capture_senders(s: PrefillScheduler) -> PrefillScheduler:
    s.senders, s.events = {}, []
    s.workers.create_senders = lambda room, _name: s.senders.setdefault(room.id, Sender())
    s.channel.send = lambda _to, ev: s.events.append(ev)
    return s


@pytest.mark.parametrize("prefill_dtype, shared", [("float32", True), ("bfloat16", False)])
def test_prefill_shares_the_decode_ranks_weights(model_dir, prefill_dtype, shared):
    cfg = _cfg(model_dir, prefill_dtype)
    decode = DecodeScheduler(cfg, cfg.decode[0])
    alone = None
    try:
        pre = _capture_senders(PrefillScheduler(cfg, cfg.prefill[0], weights_from=decode.workers))
        try:
            d, p = decode.workers.rank, pre.workers.rank
            assert p.shares_weights is shared and (p.model is d.model) is shared
            if not shared:  # another dtype is another copy
                assert next(p.model.parameters()).dtype == torch.bfloat16
                return
            assert all(a.data_ptr() == b.data_ptr() for a, b in zip(p.model.parameters(), d.model.parameters()))
            assert p.runner.pools is not d.runner.pools  # the KV stays each instance's own
            prompt = torch.randint(10, 4000, (90,), generator=torch.Generator().manual_seed(5)).tolist()
            got = prefill(pre, 1, prompt)
            own = _cfg(model_dir)
            alone = _capture_senders(PrefillScheduler(own, own.prefill[0]))  # loads its own copy
            assert prefill(alone, 1, prompt)[0] == got[0]
        finally:
            pre.close()
    finally:
        decode.close()
        if alone is not None:
            alone.close()


@pytest.mark.parametrize("sent", [True, False])
def test_prefill_runs_the_draft_only_when_it_sends_the_draft_kv(tmp_path, model_dir, sent):
    """With `draft_kv_transfer: false` decode builds the draft context itself, so a prefill rank
    that computed it anyway (issue 31 item 7: ~7 % of its forward on the CPU) must not: no draft,
    no draft_kv pool; decode keeps its draft either way. The prompt's first token is unchanged."""
    draft = write_random_draft(tmp_path / "draft", model_dir, seed=4, n_layers=2, block_size=4)
    spec = {"algorithm": "DFLASH", "draft_model_path": str(draft), "num_draft_tokens": 4, "draft_kv_transfer": sent}
    cfg = _cfg(model_dir, speculative=spec)
    decode = DecodeScheduler(cfg, cfg.decode[0])
    try:
        pre = _capture_senders(PrefillScheduler(cfg, cfg.prefill[0], weights_from=decode.workers))
        try:
            d, p = decode.workers.rank, pre.workers.rank
            assert p.shares_weights and p.model is d.model
            assert d.draft is not None and "draft_kv" in dict(d.runner.pools)
            assert (p.draft is d.draft) is sent
            assert ("draft_kv" in dict(p.runner.pools)) is sent
            assert pre.workers.sends_draft_kv is sent
            prompt = torch.randint(10, 4000, (90,), generator=torch.Generator().manual_seed(5)).tolist()
            got = prefill(pre, 1, prompt)
        finally:
            pre.close()
        plain = _cfg(model_dir)
        alone = _capture_senders(PrefillScheduler(plain, plain.prefill[0]))
        try:
            assert prefill(alone, 1, prompt)[0] == got[0]
        finally:
            alone.close()
    finally:
        decode.close()


def test_prefill_keeps_to_its_sms_while_a_request_is_on_its_way_to_decode():
    """engine/colocate.decode_busy: the whole GPU only when decode runs nothing and prefill has
    nothing in flight to it (a chunk there would hold the arriving request's first steps)."""
    from types import SimpleNamespace

    from glm53.server.engine.colocate import decode_busy

    def pair(running: int, sending: list) -> tuple:
        return SimpleNamespace(last_load=SimpleNamespace(num_running=running)), SimpleNamespace(sending=sending)

    assert not decode_busy(*pair(0, []))
    assert decode_busy(*pair(0, ["a request whose KV is in flight"]))
    assert decode_busy(*pair(3, []))
    assert decode_busy(*pair(2, ["another"]))
