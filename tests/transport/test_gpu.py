"""CUDA pools through the engine (VRAM registration, cuda_ipc / cuda_copy): skipped without a
GPU. On the device machine, from the repository root: `PYTHONPATH=. python -m pytest ...`."""

import contextlib

import pytest
import torch

from glm53.transport import BootstrapServer, KVPoll, MetadataRow, Room, TransferEngine, TransportConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@contextlib.contextmanager
def engines(src: torch.Tensor, dst: torch.Tensor):
    """A prefill and a decode engine in this process, each registering one "latent" pool."""
    cfg = TransportConfig(bootstrap_timeout_s=20, transfer_timeout_s=30)
    srv = BootstrapServer("p", 1, 1)
    p = TransferEngine("prefill", "p", config=cfg)
    p.register_pool("latent", src, range(src.shape[1]))
    p.start(srv.address)
    d = TransferEngine("decode", "d", config=cfg)
    d.register_pool("latent", dst, range(dst.shape[1]))
    d.start()
    try:
        d.connect(srv.address, timeout=20)
        yield p, d, srv.address
    finally:
        d.close()
        p.close()
        srv.close()


def test_cuda_pools_through_engine():
    src = torch.randint(0, 255, (64, 4, 64, 1152), dtype=torch.uint8, device="cuda")
    dst = torch.zeros((128, 4, 64, 1152), dtype=torch.uint8, device="cuda")
    with engines(src, dst) as (p, d, addr):
        dpages = list(range(100, 110)) + [3, 7, 50] + list(range(20, 30))
        rx = d.create_receiver(Room(1, 0), addr, dpages)
        tx = p.create_sender(Room(1, 0))
        tx.send_pages(list(range(0, 23)))
        tx.finish(MetadataRow((42,)))
        assert rx.wait(30) == KVPoll.SUCCESS, rx.error
        assert tx.wait(30) == KVPoll.SUCCESS, tx.error
        torch.cuda.synchronize()
        assert torch.equal(dst[dpages], src[:23])
        assert rx.metadata().first_token_ids == (42,)
        assert tx.stats["descs"] == 5  # runs: 100-109, 3, 7, 50, 20-29


def test_pages_sent_while_their_writes_are_queued():
    """send_pages right after queuing (not running) the writes of those pages, as prefill does
    after a forward: the transfer must carry the values the queued work writes, not the old ones."""
    src = torch.randint(0, 255, (32, 2, 64, 576), dtype=torch.uint8, device="cuda")
    dst = torch.zeros((32, 2, 64, 576), dtype=torch.uint8, device="cuda")
    with engines(src, dst) as (p, d, addr):
        rx = d.create_receiver(Room(2, 0), addr, list(range(16, 32)))
        tx = p.create_sender(Room(2, 0))
        new = torch.randint(0, 255, (16, 2, 64, 576), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the write
        src[:16].copy_(new)
        tx.send_pages(list(range(16)))
        tx.finish(MetadataRow((1,)))
        assert rx.wait(30) == KVPoll.SUCCESS, rx.error
        assert tx.wait(30) == KVPoll.SUCCESS, tx.error
        torch.cuda.synchronize()
        assert torch.equal(dst[16:], new)
