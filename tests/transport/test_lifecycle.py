"""Lifecycle in one process (two engines, each with its own NIXL agent, over UCX tcp loopback):
table mismatch at bootstrap, aborts from either side, room generations, early chunks, and the
error code each failure reports."""

import time

import numpy as np
import pytest

from glm53.transport import (BootstrapServer, KVPoll, MetadataRow, Room, TableMismatch,
                             TransferEngine, TransferErrorCode, TransportConfig)

from .engine_pair import CFG, engine_pair, pool

Code = TransferErrorCode


@pytest.fixture(autouse=True)
def _ucx_env(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_TLS", "tcp")


@pytest.fixture
def pair():
    with engine_pair(CFG) as engines:
        yield engines


def test_success_with_chunks_before_destination(pair):
    p, d, src, dst, addr = pair
    tx = p.create_sender(Room(9, 1))
    tx.send_pages([0, 1, 2])  # prefill ran ahead of decode's allocation
    tx.send_pages([3, 4])
    tx.finish(MetadataRow((77,), (5,), b"hi"))
    rx = d.create_receiver(Room(9, 1), addr)
    assert rx.poll() == KVPoll.BOOTSTRAPPING
    rx.set_destination([20, 21, 10, 11, 12])
    assert rx.wait(10) == KVPoll.SUCCESS, rx.error
    assert tx.wait(10) == KVPoll.SUCCESS, tx.error
    np.testing.assert_array_equal(dst[[20, 21, 10, 11, 12]], src[[0, 1, 2, 3, 4]])
    assert rx.metadata().first_token_ids == (77,) and rx.metadata().payload == b"hi"
    assert (dst[[0, 5, 22, 31]] == 0xEE).all()
    assert tx.stats["descs"] == 3  # runs: [0,1]->[20,21], [2]->[10], [3,4]->[11,12]
    assert rx.error_code is None and tx.error_code is None


class _Gate:
    """Stands in for the CUDA event `send_pages` records on a GPU rank: not ready until opened."""

    def __init__(self):
        self.open = False

    def query(self) -> bool:
        return self.open


def test_chunk_waits_for_the_work_that_writes_it(pair, monkeypatch):
    """A chunk whose pages are still being computed is not posted, nor is any chunk queued after
    it, nor the metadata row; once its work has run, all of it lands as written then."""
    p, d, src, dst, addr = pair
    gates = [_Gate(), _Gate()]
    monkeypatch.setattr(p, "stream_marker", lambda: gates.pop(0) if gates else None)
    first, second = gates
    tx = p.create_sender(Room(11, 0))
    rx = d.create_receiver(Room(11, 0), addr, [5, 6, 7])
    tx.send_pages([0, 1])
    tx.send_pages([2])
    tx.finish(MetadataRow((3,)))
    time.sleep(0.5)
    assert rx.poll() not in (KVPoll.SUCCESS, KVPoll.FAILED) and tx.stats["xfers"] == 0
    assert (dst[[5, 6, 7]] == 0xEE).all()
    src[[0, 1, 2]] = 7  # the "forward" finishes writing the pages
    second.open = True  # out of order: the first chunk still holds everything back
    time.sleep(0.3)
    assert tx.stats["xfers"] == 0 and rx.poll() != KVPoll.SUCCESS
    first.open = True
    assert rx.wait(10) == KVPoll.SUCCESS, rx.error
    assert tx.wait(10) == KVPoll.SUCCESS, tx.error
    assert (dst[[5, 6, 7]] == 7).all()


def test_decode_abort_fails_sender(pair):
    p, d, src, dst, addr = pair
    tx = p.create_sender(Room(1, 0))
    rx = d.create_receiver(Room(1, 0), addr, [3, 4])
    tx.send_pages([0])
    rx.abort("client went away")
    assert rx.wait(10) == KVPoll.FAILED
    assert tx.wait(10) == KVPoll.FAILED and "client went away" in tx.error
    assert rx.error_code == Code.ABORTED and tx.error_code == Code.ABORTED


def test_prefill_abort_fails_receiver(pair):
    p, d, src, dst, addr = pair
    tx = p.create_sender(Room(2, 0))
    rx = d.create_receiver(Room(2, 0), addr, [3, 4])
    tx.send_pages([0, 1])
    tx.abort("prefill OOM")
    assert tx.wait(10) == KVPoll.FAILED
    assert rx.wait(10) == KVPoll.FAILED and "prefill OOM" in rx.error
    assert tx.error_code == Code.ABORTED and rx.error_code == Code.ABORTED


def test_retried_room_new_generation(pair):
    p, d, src, dst, addr = pair
    old_tx = p.create_sender(Room(5, 0))
    old_rx = d.create_receiver(Room(5, 0), addr, [1, 2])
    old_tx.send_pages([0, 1])
    # the router retries the room with generation 1 (new pages)
    new_rx = d.create_receiver(Room(5, 1), addr, [8, 9])
    new_tx = p.create_sender(Room(5, 1))
    assert old_tx.wait(10) == KVPoll.FAILED and "superseded" in old_tx.error
    assert old_rx.wait(10) == KVPoll.FAILED
    assert old_tx.error_code == Code.SUPERSEDED and old_rx.error_code == Code.SUPERSEDED
    new_tx.send_pages([4, 5])
    new_tx.finish(MetadataRow((3,)))
    assert new_rx.wait(10) == KVPoll.SUCCESS, new_rx.error
    assert new_rx.metadata().generation == 1
    np.testing.assert_array_equal(dst[[8, 9]], src[[4, 5]])
    # a late receiver for the retired generation is refused by prefill
    stale = d.create_receiver(Room(5, 0), addr, [12])
    assert stale.wait(10) == KVPoll.FAILED and "superseded" in stale.error
    assert stale.error_code == Code.SUPERSEDED


def test_last_stage_must_send_row(pair):
    p, d, src, dst, addr = pair
    tx = p.create_sender(Room(6, 0))
    rx = d.create_receiver(Room(6, 0), addr, [1])
    tx.send_pages([0])
    tx.finish(None)
    assert tx.wait(10) == KVPoll.FAILED and "metadata row" in tx.error
    assert rx.wait(10) == KVPoll.FAILED
    assert tx.error_code == Code.INVALID and rx.error_code == Code.INVALID


def test_bootstrap_rejects_mismatch_naming_field():
    srv = BootstrapServer("p", 1, 1)
    p = TransferEngine("prefill", "p", config=TransportConfig(**CFG))
    p.register_pool("latent", pool(8, page=4), (0, 1))
    p.start(srv.address)
    d = TransferEngine("decode", "d", config=TransportConfig(**CFG))
    d.register_pool("latent", pool(8, page=8), (0, 1))
    d.start()
    try:
        with pytest.raises(TableMismatch) as e:
            d.connect(srv.address, timeout=10)
        assert e.value.field == "page_size"
        rx = d.create_receiver(Room(1, 0), srv.address, [0])
        assert rx.wait(10) == KVPoll.FAILED and rx.error_field == "page_size"
        assert "page_size" in rx.error
        assert rx.error_code == Code.TABLE_MISMATCH
    finally:
        d.close()
        p.close()
        srv.close()


def test_unreachable_bootstrap_times_out():
    d = TransferEngine("decode", "d", config=TransportConfig(**dict(CFG, bootstrap_timeout_s=1)))
    d.register_pool("latent", pool(8), (0, 1))
    d.start()
    try:
        rx = d.create_receiver(Room(1, 0), "tcp://127.0.0.1:1", [0])
        assert rx.wait(5) == KVPoll.FAILED and "bootstrap timeout" in rx.error
        assert rx.error_code == Code.BOOTSTRAP_TIMEOUT
    finally:
        d.close()


def test_sender_without_destination_times_out():
    with engine_pair(dict(CFG, bootstrap_timeout_s=1.0)) as (p, d, src, dst, addr):
        tx = p.create_sender(Room(3, 0))  # no decode rank ever sends ROOM for it
        tx.send_pages([0])
        # Decode never admitted it (its queue): a queue wait, not a transfer fault.
        assert tx.wait(5) == KVPoll.FAILED and tx.error_code == Code.QUEUE_TIMEOUT


def test_transfer_timeout_code():
    with engine_pair(dict(CFG, transfer_timeout_s=1.0)) as (p, d, src, dst, addr):
        tx = p.create_sender(Room(4, 0))
        rx = d.create_receiver(Room(4, 0), addr, [1, 2])
        tx.send_pages([0, 1])  # never finished: no commit arrives
        assert rx.wait(5) == KVPoll.FAILED and tx.wait(5) == KVPoll.FAILED
        # whichever side timed out first, the other reports the same cause
        assert rx.error_code == Code.TRANSFER_TIMEOUT and tx.error_code == Code.TRANSFER_TIMEOUT


def test_close_fails_live_rooms_with_code(pair):
    p, d, src, dst, addr = pair
    tx = p.create_sender(Room(10, 0))
    rx = d.create_receiver(Room(10, 0), addr, [1])
    tx.send_pages([0])
    deadline = time.monotonic() + 10
    while rx.poll() != KVPoll.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.005)  # the write landed: nothing is in flight when decode closes
    d.close()
    assert rx.poll() == KVPoll.FAILED and rx.error_code == Code.CLOSED
    assert tx.wait(10) == KVPoll.FAILED and tx.error_code == Code.CLOSED
