"""Several ranks, one room: ``combine_polls`` over every small state tuple, and ``RoomTransfer``
with real engines (prefill TP 2 -> decode TP 2, four engines in one process over UCX loopback)."""

import itertools

import numpy as np
import pytest

from glm53.transport import (TERMINAL, BootstrapServer, KVPoll, MetadataRow, Room, RoomTransfer,
                             TransferEngine, TransferError, TransferErrorCode, TransportConfig,
                             combine_polls)

Code = TransferErrorCode
CFG = dict(bootstrap_timeout_s=10.0, transfer_timeout_s=10.0, heartbeat_interval_s=0.2,
           peer_timeout_s=4.0, quiesce_timeout_s=2.0)


# -- combine_polls ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_combine_polls_exhaustive(n):
    for states in itertools.product(list(KVPoll), repeat=n):
        got = combine_polls(states)
        live = [s for s in states if s not in TERMINAL]
        if not live:
            assert got == (KVPoll.FAILED if KVPoll.FAILED in states else KVPoll.SUCCESS), states
        else:  # some rank may still be written: not terminal, and no further than any live rank
            assert got not in TERMINAL and got in states, states
            assert all(got <= s for s in live), states
    assert combine_polls([KVPoll.SUCCESS, KVPoll.FAILED]) == KVPoll.FAILED
    assert combine_polls([KVPoll.FAILED, KVPoll.TRANSFERRING]) == KVPoll.TRANSFERRING
    assert combine_polls([KVPoll.SUCCESS, KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING]) == \
        KVPoll.WAITING_FOR_INPUT


def test_combine_polls_needs_a_state():
    with pytest.raises(ValueError):
        combine_polls([])


# -- RoomTransfer with real engines -----------------------------------------------------------
@pytest.fixture(autouse=True)
def _ucx_env(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_TLS", "tcp")


def _pool(n_pages, fill=0):
    return np.full((n_pages, 2, 4, 64), fill, dtype=np.uint8)


@pytest.fixture
def ranks():
    """Prefill TP 2 and decode TP 2: decode rank d gets its metadata row from prefill rank d."""
    srv = BootstrapServer("p", 1, 2)
    src = _pool(16)
    src[:] = np.arange(src.size, dtype=np.uint64).reshape(src.shape) % 251
    engines, pre, dec, dsts = [], [], [], []
    try:
        for t in range(2):
            p = TransferEngine("prefill", "p", 2, t, config=TransportConfig(**CFG))
            engines.append(p)
            p.register_pool("latent", src, (0, 1))  # replicated: every rank holds the same
            p.start(srv.address)
            pre.append(p)
        for t in range(2):
            d = TransferEngine("decode", "d", 2, t, config=TransportConfig(**CFG))
            engines.append(d)
            dsts.append(_pool(16, fill=0xEE))
            d.register_pool("latent", dsts[-1], (0, 1))
            d.start()
            dec.append(d)
        for d in dec:
            d.connect(srv.address, timeout=20)
        yield pre, dec, src, dsts, srv.address
    finally:
        for e in reversed(engines):
            e.close()
        srv.close()


def test_room_transfer_success(ranks):
    pre, dec, src, dsts, addr = ranks
    room = Room(7, 2)
    tx = RoomTransfer([p.create_sender(room) for p in pre])
    rx = RoomTransfer([d.create_receiver(room, addr, [5, 6, 9]) for d in dec])
    tx.send_pages([0, 1, 2])
    tx.finish(MetadataRow((11,), (3,), b"x"))
    assert rx.wait(20) == KVPoll.SUCCESS, rx.error
    assert tx.wait(20) == KVPoll.SUCCESS, tx.error
    assert rx.error == "" and rx.error_code is None and tx.error_code is None
    row = rx.metadata()
    assert (row.first_token_ids, row.payload, row.generation) == ((11,), b"x", 2)
    for dst in dsts:
        np.testing.assert_array_equal(dst[[5, 6, 9]], src[[0, 1, 2]])


def test_one_rank_failed_is_failed_only_when_all_terminal(ranks):
    pre, dec, src, dsts, addr = ranks
    room = Room(8, 0)
    rx0 = dec[0].create_receiver(room, addr, [1, 2])
    rx1 = dec[1].create_receiver(room, addr)  # no pages yet: rank 1 stays BOOTSTRAPPING
    rt = RoomTransfer([rx0, rx1])
    rx0.abort("rank 0 gave up")
    assert rx0.wait(10) == KVPoll.FAILED
    assert rx1.poll() == KVPoll.BOOTSTRAPPING
    assert rt.poll() == KVPoll.BOOTSTRAPPING  # rank 1's pages may still be written
    assert rt.error_code == Code.ABORTED and "rank 0 gave up" in rt.error
    with pytest.raises(TransferError) as e:
        rt.metadata()
    assert e.value.code == Code.INVALID
    # Rank 1's ROOM reaches prefill ranks that saw rank 0's ABORT: their senders fail on
    # creation and tell rank 1.
    rx1.set_destination([1, 2])
    txs = [p.create_sender(room) for p in pre]
    assert rx1.wait(10) == KVPoll.FAILED, rx1.error
    assert all(tx.wait(10) == KVPoll.FAILED for tx in txs)
    assert rt.poll() == KVPoll.FAILED
    assert rt.error_code == Code.ABORTED and "rank 0 gave up" in rt.error  # the first failure
    assert rx1.error_code == Code.ABORTED and all(tx.error_code == Code.ABORTED for tx in txs)


def test_room_transfer_abort_fans_out(ranks):
    pre, dec, src, dsts, addr = ranks
    room = Room(12, 0)
    tx = RoomTransfer([p.create_sender(room) for p in pre])
    rx = RoomTransfer([d.create_receiver(room, addr, [3, 4]) for d in dec])
    tx.send_pages([0])
    rx.abort("client went away")
    assert rx.wait(10) == KVPoll.FAILED and rx.error_code == Code.ABORTED
    assert tx.wait(10) == KVPoll.FAILED and tx.error_code == Code.ABORTED
    assert "client went away" in tx.error


def test_metadata_rows_must_agree(ranks):
    pre, dec, src, dsts, addr = ranks
    room = Room(9, 0)
    txs = [p.create_sender(room) for p in pre]
    rt = RoomTransfer([d.create_receiver(room, addr, [3]) for d in dec])
    for i, tx in enumerate(txs):  # each prefill rank writes its decode rank a different row
        tx.send_pages([0])
        tx.finish(MetadataRow((100 + i,)))
    assert rt.wait(20) == KVPoll.FAILED
    assert all(h.poll() == KVPoll.SUCCESS for h in rt.handles)
    assert rt.error_code == Code.INTEGRITY and "metadata rows disagree" in rt.error
    with pytest.raises(TransferError) as e:
        rt.metadata()
    assert e.value.code == Code.INTEGRITY


def test_room_transfer_checks_its_handles(ranks):
    pre, dec, src, dsts, addr = ranks
    a, b = pre[0].create_sender(Room(20, 0)), pre[1].create_sender(Room(21, 0))
    with pytest.raises(ValueError):
        RoomTransfer([a, b])
    rx = dec[0].create_receiver(Room(20, 0), addr)
    with pytest.raises(TypeError):
        RoomTransfer([a, rx])
    with pytest.raises(TypeError):
        RoomTransfer([rx]).send_pages([0])
    with pytest.raises(TypeError):
        RoomTransfer([a]).metadata()
    with pytest.raises(ValueError):
        RoomTransfer([])
