"""Two transfer engines in one process, each with its own NIXL agent, over UCX tcp loopback
(the tests set UCX_NET_DEVICES=lo, UCX_TLS=tcp): prefill's with a pool of known bytes, decode's
with a pool of 0xEE, bootstrapped and connected (`engine_pair`; `CFG` its short timeouts). Used
by test_lifecycle.py and test_transfer_clock.py."""

import contextlib

import numpy as np

from glm53.transport import BootstrapServer, TransferEngine, TransportConfig

CFG = dict(bootstrap_timeout_s=5.0, transfer_timeout_s=5.0, heartbeat_interval_s=0.2,
           peer_timeout_s=2.0, quiesce_timeout_s=2.0)


def pool(n_pages, layers=2, page=4, bpt=64, fill=0):
    return np.full((n_pages, layers, page, bpt), fill, dtype=np.uint8)


@contextlib.contextmanager
def engine_pair(cfg):
    srv = BootstrapServer("p", 1, 1)
    p = TransferEngine("prefill", "p", config=TransportConfig(**cfg))
    src = pool(32)
    src[:] = np.arange(src.size, dtype=np.uint64).reshape(src.shape) % 251
    p.register_pool("latent", src, (0, 1))
    p.start(srv.address)
    d = TransferEngine("decode", "d", config=TransportConfig(**cfg))
    dst = pool(32, fill=0xEE)
    d.register_pool("latent", dst, (0, 1))
    d.start()
    d.connect(srv.address, timeout=10)
    try:
        yield p, d, src, dst, srv.address
    finally:
        d.close()
        p.close()
        srv.close()
