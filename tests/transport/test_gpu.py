"""CUDA pools through the engine (VRAM registration, cuda_ipc / cuda_copy): skipped without a
GPU. On the device machine: `source tools/device_env.sh` first."""

import pytest
import torch

from glm53.transport import BootstrapServer, KVPoll, MetadataRow, Room, TransferEngine, TransportConfig


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pools_through_engine():
    cfg = TransportConfig(bootstrap_timeout_s=20, transfer_timeout_s=30)
    srv = BootstrapServer("p", 1, 1)
    p = TransferEngine("prefill", "p", config=cfg)
    src = torch.randint(0, 255, (64, 4, 64, 1152), dtype=torch.uint8, device="cuda")
    p.register_pool("latent", src, range(4))
    p.start(srv.address)
    d = TransferEngine("decode", "d", config=cfg)
    dst = torch.zeros((128, 4, 64, 1152), dtype=torch.uint8, device="cuda")
    d.register_pool("latent", dst, range(4))
    d.start()
    try:
        d.connect(srv.address, timeout=20)
        dpages = list(range(100, 110)) + [3, 7, 50] + list(range(20, 30))
        rx = d.create_receiver(Room(1, 0), srv.address, dpages)
        tx = p.create_sender(Room(1, 0))
        tx.send_pages(list(range(0, 23)))
        tx.finish(MetadataRow((42,)))
        assert rx.wait(30) == KVPoll.SUCCESS, rx.error
        assert tx.wait(30) == KVPoll.SUCCESS, tx.error
        torch.cuda.synchronize()
        assert torch.equal(dst[dpages], src[:23])
        assert rx.metadata().first_token_ids == (42,)
        assert tx.stats["descs"] == 5  # runs: 100-109, 3, 7, 50, 20-29
    finally:
        d.close()
        p.close()
        srv.close()

