"""Free TCP ports on loopback, for tests, benchmarks and tools that start real servers.

The ports are drawn below the kernel's ephemeral range (`ip_local_port_range`). A caller writes
them into a config that another process binds seconds later; in between, every socket opened
without a port (a zmq random port, a gloo or UCX connection, an HTTP client) takes one from the
ephemeral range, and one of those took a chosen port in CI ("cannot bind: Address already in
use"). A port below that range can only be taken by a process that names it.

The router's default HTTP port is never drawn: a config that writes chosen ports for its
instances and leaves the router at its default would clash with itself (a CI run drew 30000).
"""

import random
import socket

from glm53.server.config import RouterConfig

LOWEST = 10_000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(n: int, exclude=()) -> list[int]:
    """`n` distinct TCP ports free on 127.0.0.1 right now (all held open while choosing), none in
    `exclude` (ports a config already names), below the ephemeral range where it leaves room."""
    hi = _ephemeral_start()
    socks: list[socket.socket] = []
    ports: list[int] = []
    taken = {*exclude, RouterConfig.port}
    try:
        if hi - LOWEST >= 1000:
            rng = random.Random()  # seeded from the OS: concurrent choosers draw differently
            for _ in range(100 * n):
                if len(ports) == n:
                    break
                p = rng.randrange(LOWEST, hi)
                if p in taken:
                    continue
                taken.add(p)
                s = socket.socket()
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    s.close()
                    continue
                socks.append(s)
                ports.append(p)
        while len(ports) < n:  # no room below the range (or it is full): the kernel's choice
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            p = s.getsockname()[1]
            if p not in taken:
                taken.add(p)
                ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports
