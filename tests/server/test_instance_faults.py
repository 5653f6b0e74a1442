"""Fault containment inside a real decode instance (model, transfer engine, ZMQ channel): a
failing engine step fails the requests it holds with an "internal" error event, frees their
pages, and the instance keeps serving; out-of-vocabulary ids are a bad request, never a crash."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import zmq

from glm53.server.config_parse import parse_config
from glm53.server.engine.decode import DecodeScheduler
from glm53.server.protocol import GenerateRequest, PeerInfo, RequestSpec, TokenEvent, decode, decode_all, encode
from glm53.server.sampling import SamplingParams
from glm53.support.ports import free_ports


def _request(room: int, ids: list[int], reply_to: str, ports: list[int]) -> GenerateRequest:
    spec = RequestSpec(f"r{room}", ids, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True), [])
    return GenerateRequest(
        spec=spec, room=room, generation=0,
        prefill=PeerInfo("p0", "prefill", "127.0.0.1", ports[0], ports[1]),
        decode=PeerInfo("d0", "decode", "127.0.0.1", ports[2], None), reply_to=reply_to)


@dataclass
class Serving:
    """A decode instance serving on a thread, and the router's two sockets to it."""

    sched: DecodeScheduler
    ports: list[int]
    push: zmq.Socket  # to the instance
    pull: zmq.Socket  # its events and pongs
    reply_to: str
    thread: threading.Thread


@contextmanager
def serving_decode(model_dir, monkeypatch, **sections):
    """A CPU decode instance `d0` (prefill peer `p0` configured, never started) with the config
    `sections` over the defaults, serving until the block ends; then stopped, its thread joined."""
    ports = free_ports(4)
    cfg = parse_config({
        "model": {"path": str(model_dir)},
        "defaults": {"device": "cpu", "dtype": "float32", "page_size": 16, "num_pages": 64},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1]}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2]}],
        **sections,
    })
    sched = DecodeScheduler(cfg, cfg.decode[0])
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    reply_to = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    push.connect(cfg.decode[0].address)
    thread = threading.Thread(target=sched.serve_forever, daemon=True)
    thread.start()
    try:
        yield Serving(sched, ports, push, pull, reply_to, thread)
    finally:
        monkeypatch.undo()
        sched.stop()
        thread.join(timeout=10)
        sched.close()
        pull.close(0)
        push.close(0)
        ctx.term()
    assert not thread.is_alive()


def test_step_exception_fails_requests_and_the_instance_lives_on(model_dir, monkeypatch):
    with serving_decode(model_dir, monkeypatch, router={"max_queue_wait_s": 2},
                        transfer={"bootstrap_timeout_s": 2, "transfer_timeout_s": 5}) as sv:
        sched, ports, push, pull, reply_to = sv.sched, sv.ports, sv.push, sv.pull, sv.reply_to

        def boom(n):
            raise RuntimeError("allocator exploded")

        monkeypatch.setattr(sched.allocator, "alloc", boom)
        push.send(encode(_request(1, [5, 6, 7], reply_to, ports)))
        assert pull.poll(20_000), "no event for the failed request"
        ev = decode(pull.recv())
        assert isinstance(ev, TokenEvent) and ev.room == 1 and ev.finish_reason == "error"
        assert ev.error_code == "internal" and "allocator exploded" in ev.error

        monkeypatch.undo()
        vocab = sched.cfg.vocab_size
        push.send(encode(_request(2, [5, vocab + 3], reply_to, ports)))
        assert pull.poll(20_000)
        ev = decode(pull.recv())
        assert ev.room == 2 and ev.error_code == "bad_request" and str(vocab) in ev.error

        # A request that cannot get pages within the queue bound (router.max_queue_wait_s, or
        # what the router says is left of it) fails as overloaded, never as a transfer fault.
        held = sched.allocator.alloc(64)
        t0 = time.monotonic()
        push.send(encode(_request(3, [5, 6, 7], reply_to, ports)))
        assert pull.poll(20_000)
        ev = decode(pull.recv())
        assert ev.room == 3 and ev.error_code == "overloaded" and "max_queue_wait_s" in ev.error
        bound = sched.cluster.router.max_queue_wait_s
        assert bound <= time.monotonic() - t0 < bound + 5
        req = _request(4, [5, 6, 7], reply_to, ports)
        req.queue_budget_s = 0.5  # the router's queue took the rest
        t0 = time.monotonic()
        push.send(encode(req))
        assert pull.poll(20_000)
        ev = decode(pull.recv())
        assert ev.room == 4 and ev.error_code == "overloaded"
        assert 0.5 <= time.monotonic() - t0 < 1.5
        sched.allocator.free(held)
        assert sv.thread.is_alive() and sched.allocator.num_free == 64


def test_a_lost_rank_fails_each_request_with_the_reason_before_pongs_say_not_ready(model_dir, monkeypatch):
    # The instance's IO thread answers pings on its own, and the router fails every room of an
    # instance whose pong says not ready as "stopped responding". When a rank is lost the held
    # requests must fail with the reason first. A ping is answered in the middle of `fail_all`
    # (where a racing ping lands); its pong, and every message after it, must not say not ready
    # before each held request's error event has left.
    from glm53.server.engine.processes import RanksLost
    from glm53.server.protocol import HealthPing, HealthPong

    with serving_decode(model_dir, monkeypatch, transfer={"bootstrap_timeout_s": 60, "transfer_timeout_s": 60}) as sv:
        sched, ports, push, pull, reply_to = sv.sched, sv.ports, sv.push, sv.pull, sv.reply_to
        received: list = []

        def receive(timeout_s: float) -> None:
            if pull.poll(int(timeout_s * 1000)):
                received.extend(decode_all(pull.recv()))  # a step's events leave as one frame

        for room in (1, 2):  # held: their prefill never sends the KV
            push.send(encode(_request(room, [5, 6, 7], reply_to, ports)))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and sched.last_load.num_transferring + sched.last_load.num_waiting < 2:
            time.sleep(0.05)
        assert sched.last_load.num_transferring + sched.last_load.num_waiting == 2, sched.last_load

        fail_all = sched.fail_all

        def fail_all_while_pinged(message: str) -> None:
            push.send(encode(HealthPing(seq=1, reply_to=reply_to)))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(isinstance(m, HealthPong) for m in received):
                receive(0.1)
            fail_all(message)

        def lose_a_rank() -> None:
            raise RanksLost("rank 1 lost: connection reset by peer")

        monkeypatch.setattr(sched, "fail_all", fail_all_while_pinged)
        monkeypatch.setattr(sched.workers, "sync", lose_a_rank)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not sched.broken:
            receive(0.1)
        assert sched.broken
        for seq in range(2, 50):  # now the pongs say not ready
            push.send(encode(HealthPing(seq=seq, reply_to=reply_to)))
            receive(1.0)
            if any(isinstance(m, HealthPong) and not m.ready for m in received):
                break
        while pull.poll(200):
            receive(0)
        not_ready = next(i for i, m in enumerate(received) if isinstance(m, HealthPong) and not m.ready)
        failed = [(i, m) for i, m in enumerate(received) if isinstance(m, TokenEvent) and m.finish_reason == "error"]
        assert sorted(m.room for _, m in failed) == [1, 2], received
        assert max(i for i, _ in failed) < not_ready, received
        assert all("lost a rank" in m.error and "connection reset" in m.error for _, m in failed), received
