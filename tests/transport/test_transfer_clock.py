"""Decode's two clocks (docs/ARCHITECTURE.md, "Transfer lifecycle"): prefill's queue is bounded by
the queue timeout (queue_timeout_s, else the bootstrap timeout) and fails as QUEUE_TIMEOUT, and
the transfer timeout starts only when prefill admits the room (ACCEPTED), so a room that waits
long in prefill's queue is not a transfer failure. Two engines,
each with its own NIXL agent, over UCX tcp loopback."""

import time

import numpy as np
import pytest

from glm53.transport import KVPoll, MetadataRow, Room, TransferErrorCode

from .engine_pair import CFG, engine_pair

Code = TransferErrorCode


@pytest.fixture(autouse=True)
def _ucx_env(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_TLS", "tcp")


def test_queue_wait_longer_than_transfer_timeout_succeeds():
    with engine_pair(dict(CFG, bootstrap_timeout_s=8.0, transfer_timeout_s=1.0)) as (p, d, src, dst, addr):
        rx = d.create_receiver(Room(21, 0), addr, [5, 6])
        deadline = time.monotonic() + 5
        while rx.poll() == KVPoll.BOOTSTRAPPING and time.monotonic() < deadline:
            time.sleep(0.005)
        assert rx.poll() == KVPoll.WAITING_FOR_INPUT  # ROOM sent: the old clock started here
        time.sleep(2.5)  # prefill's queue: 2.5x the transfer timeout
        assert rx.poll() == KVPoll.WAITING_FOR_INPUT, rx.error
        tx = p.create_sender(Room(21, 0))  # admission
        tx.send_pages([3, 4])
        tx.finish(MetadataRow((11,), (2,)))
        assert rx.wait(10) == KVPoll.SUCCESS, rx.error
        assert tx.wait(10) == KVPoll.SUCCESS, tx.error
        np.testing.assert_array_equal(dst[[5, 6]], src[[3, 4]])


def test_never_admitted_fails_as_queue_timeout():
    with engine_pair(dict(CFG, bootstrap_timeout_s=1.5, transfer_timeout_s=0.5)) as (p, d, src, dst, addr):
        t0 = time.monotonic()
        rx = d.create_receiver(Room(22, 0), addr, [1])
        assert rx.wait(10) == KVPoll.FAILED
        assert rx.error_code == Code.QUEUE_TIMEOUT, rx.error
        assert time.monotonic() - t0 >= 1.4  # not the 0.5 s transfer timeout


def test_queue_wait_longer_than_bootstrap_timeout_succeeds():
    """Servers bound the queue by router.max_queue_wait_s, not the bootstrap timeout: a room
    queued on prefill past the bootstrap timeout (but within queue_timeout_s) still succeeds."""
    cfg = dict(CFG, bootstrap_timeout_s=1.0, queue_timeout_s=8.0, transfer_timeout_s=1.0)
    with engine_pair(cfg) as (p, d, src, dst, addr):
        rx = d.create_receiver(Room(24, 0), addr, [5, 6])
        time.sleep(2.5)  # queued: 2.5x the bootstrap timeout
        assert rx.poll() == KVPoll.WAITING_FOR_INPUT, rx.error
        tx = p.create_sender(Room(24, 0))
        tx.send_pages([3, 4])
        tx.finish(MetadataRow((11,), (2,)))
        assert rx.wait(10) == KVPoll.SUCCESS, rx.error
        assert tx.wait(10) == KVPoll.SUCCESS, tx.error


def test_transfer_clock_runs_from_admission():
    with engine_pair(dict(CFG, bootstrap_timeout_s=8.0, transfer_timeout_s=1.0)) as (p, d, src, dst, addr):
        rx = d.create_receiver(Room(23, 0), addr, [1, 2])
        time.sleep(1.5)  # queued longer than the transfer timeout: still fine
        t_admit = time.monotonic()
        tx = p.create_sender(Room(23, 0))
        tx.send_pages([0])  # never finished: no commit arrives
        assert rx.wait(10) == KVPoll.FAILED and tx.wait(10) == KVPoll.FAILED
        assert rx.error_code == Code.TRANSFER_TIMEOUT, rx.error
        assert 0.8 <= time.monotonic() - t_admit < 5
