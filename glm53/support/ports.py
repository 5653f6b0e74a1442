"""Free TCP ports on loopback, for tests, benchmarks and tools that start real servers."""

import socket


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on 127.0.0.1 right now (all held open while choosing)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports
