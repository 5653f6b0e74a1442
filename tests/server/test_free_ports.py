"""`support.ports.free_ports`: the ports tests pin in their configs."""

import socket

from glm53.support import ports


def test_ports_are_distinct_bindable_outside_the_ephemeral_range_and_skip_named_ones():
    first = ports.free_ports(6)
    more = ports.free_ports(6, exclude=first)
    assert len(set(first + more)) == 12
    hi = ports._ephemeral_start()
    if hi - ports.LOWEST >= 1000:
        assert all(ports.LOWEST <= p < hi for p in first + more)
    for p in first + more:  # free right now
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_held_port_is_never_handed_out(monkeypatch):
    # a port another socket holds fails the trial bind and is skipped
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    p = held.getsockname()[1]
    draws = iter([p, p] + [q for q in range(20_000, 20_200) if q != p])
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 65536)
    monkeypatch.setattr(ports.random.Random, "randrange", lambda self, a, b: next(draws))
    try:
        got = ports.free_ports(1)
        assert got != [p]
    finally:
        held.close()


def test_the_routers_default_port_is_never_handed_out(monkeypatch):
    # a config naming chosen instance ports leaves the router at its default (30000): never drawn
    from glm53.server.config import RouterConfig

    draws = iter([RouterConfig.port, RouterConfig.port, *range(20_000, 20_200)])
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 65536)
    monkeypatch.setattr(ports.random.Random, "randrange", lambda self, a, b: next(draws))
    assert RouterConfig.port not in ports.free_ports(2)
