import msgpack
import pytest
import zmq

from glm53.server.protocol import (PROTOCOL_VERSION, Abort, GenerateRequest, HealthPing, HealthPong,
                                   InstanceChannel, LoadStats, PeerInfo, ProtocolError, RequestSpec, TokenEvent,
                                   TransferStats, decode, decode_all, encode, encode_batch, probe)
from glm53.server.sampling import SamplingParams
from glm53.support.ports import free_ports


def _req(**kw) -> GenerateRequest:
    p = PeerInfo("p0", "prefill", "127.0.0.1", 1, 2)
    d = PeerInfo("d0", "decode", "127.0.0.1", 3, 4)
    spec = RequestSpec(rid="r", input_ids=[1, 2, 3], eos_token_ids=[9],
                       params=SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=[7], seed=2**63,
                                             stop=["\n\n"], no_stop_trim=True, presence_penalty=0.5,
                                             repetition_penalty=1.2, logit_bias={"4": -3.0}, min_new_tokens=2),
                       n=3, logprobs=2, prompt_logprobs_start=1)
    base = dict(spec=spec, room=2**63 - 1, generation=2**32 - 1, prefill=p, decode=d, reply_to="tcp://127.0.0.1:9")
    base.update(kw)
    return GenerateRequest(**base)


def test_round_trip_every_message():
    msgs = [_req(), Abort(room=5, generation=1, reason="client"), HealthPing(seq=3, reply_to="tcp://x:1"),
            TokenEvent(room=5, generation=1, instance="d0", token_ids=[1, 2], finish_reason="stop", matched_stop=2,
                       prompt_tokens=3, completion_tokens=2, transfer=TransferStats(0.5, 1024, 0.1), index=2,
                       logprobs=[-0.5, -1.5], top_logprobs=[[[1, -0.5]], [[2, -1.5]]]),
            TokenEvent(room=5, generation=1, instance="p0", prompt_logprobs=[None, -2.0],
                       prompt_top_logprobs=[[], [[3, -1.0]]]),
            HealthPong(seq=3, instance="d0", role="decode", ready=True, load=LoadStats(num_running=2))]
    for m in msgs:
        assert decode(encode(m)) == m


def test_invalid_messages_are_rejected():
    with pytest.raises(ProtocolError):
        decode(b"\xc1")
    with pytest.raises(ProtocolError):
        decode(msgpack.packb({"type": "abort", "v": PROTOCOL_VERSION + 1, "room": 1, "generation": 0}))
    with pytest.raises(ProtocolError):
        decode(msgpack.packb({"type": "launch", "v": PROTOCOL_VERSION}))
    with pytest.raises(ProtocolError):
        decode(msgpack.packb({"type": "abort", "v": PROTOCOL_VERSION}))  # room missing
    with pytest.raises(ProtocolError):
        decode(msgpack.packb({"type": "tokens", "v": PROTOCOL_VERSION, "room": 1, "generation": 0,
                              "instance": "d0", "finish_reason": "done"}))
    # a newer peer's extra fields are ignored
    d = _req().to_dict()
    d["future_field"] = 1
    assert decode(msgpack.packb(d)) == _req()


def test_instance_channel_answers_pings_and_queues_requests():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    reply_to = f"tcp://127.0.0.1:{port}"
    (inst_port,) = free_ports(1)  # a plain socket: released synchronously, unlike a zmq one
    ch = InstanceChannel(f"tcp://127.0.0.1:{inst_port}", "d0", "decode", load_fn=lambda: LoadStats(num_waiting=4))
    try:
        assert probe({"d0": f"tcp://127.0.0.1:{inst_port}"}, timeout=0.5) == set()  # not ready yet
        ch.ready = True
        assert probe({"d0": f"tcp://127.0.0.1:{inst_port}"}, timeout=5) == {"d0"}
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{inst_port}")
        push.send(encode(HealthPing(seq=1, reply_to=reply_to)))
        push.send(encode(_req(reply_to=reply_to)))
        push.send(encode(Abort(room=1, generation=0)))
        assert pull.poll(5000)
        pong = decode(pull.recv())
        assert isinstance(pong, HealthPong) and pong.load.num_waiting == 4 and pong.ready
        assert isinstance(ch.get(timeout=5), GenerateRequest)
        assert isinstance(ch.get(timeout=5), Abort)
        ch.send(reply_to, TokenEvent(room=1, generation=0, instance="d0", token_ids=[3]))
        assert pull.poll(5000) and decode(pull.recv()).token_ids == [3]
        push.close(0)
    finally:
        ch.close()
        pull.close(0)
        ctx.term()


def test_batch_frames_round_trip_and_are_checked():
    evs = [TokenEvent(room=r, generation=1, instance="d0", token_ids=[r, r + 1]) for r in range(5)]
    assert decode_all(encode_batch(evs)) == evs
    assert decode_all(encode(evs[0])) == [evs[0]]
    with pytest.raises(ProtocolError):
        decode(encode_batch(evs))  # one message expected
    with pytest.raises(ProtocolError):
        decode_all(msgpack.packb({"type": "batch", "v": PROTOCOL_VERSION, "msgs": 3}))
    with pytest.raises(ProtocolError):
        decode_all(msgpack.packb({"type": "batch", "v": PROTOCOL_VERSION + 1, "msgs": []}))
    bad = evs[0].to_dict()
    bad["v"] = PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError):
        decode_all(msgpack.packb({"type": "batch", "v": PROTOCOL_VERSION, "msgs": [evs[1].to_dict(), bad]}))


def test_batched_sends_leave_as_one_frame_per_destination_in_order():
    ctx = zmq.Context()
    pulls = [ctx.socket(zmq.PULL) for _ in range(2)]
    addrs = [f"tcp://127.0.0.1:{p.bind_to_random_port('tcp://127.0.0.1')}" for p in pulls]
    (inst_port,) = free_ports(1)
    ch = InstanceChannel(f"tcp://127.0.0.1:{inst_port}", "d0", "decode")
    ch.ready = True
    try:
        ev = [TokenEvent(room=r, generation=0, instance="d0", token_ids=[r]) for r in range(7)]
        with ch.batched():
            for e in ev[:5]:
                ch.send(addrs[0], e)
            ch.send(addrs[1], ev[5])
            with ch.batched():  # nested: still held
                ch.send(addrs[0], ev[6])
            # the IO thread answers a ping while the engine holds its events: never held back
            assert probe({"d0": f"tcp://127.0.0.1:{inst_port}"}, timeout=5) == {"d0"}
            assert not pulls[0].poll(200) and not pulls[1].poll(0)
        assert pulls[0].poll(5000) and decode_all(pulls[0].recv()) == ev[:5] + [ev[6]]
        assert pulls[1].poll(5000) and decode(pulls[1].recv()) == ev[5]  # one message: a plain frame
        assert not pulls[0].poll(200)
        ch.send(addrs[1], ev[0])  # outside a batch: at once
        assert pulls[1].poll(5000) and decode(pulls[1].recv()) == ev[0]
    finally:
        ch.close()
        for p in pulls:
            p.close(0)
        ctx.term()


def test_flush_sends_what_a_batch_holds_so_far_and_the_batch_goes_on_holding():
    """Decode flushes adopted requests' first tokens before the step's decode runs (their TTFT)."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    addr = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    (inst_port,) = free_ports(1)
    ch = InstanceChannel(f"tcp://127.0.0.1:{inst_port}", "d0", "decode")
    try:
        ev = [TokenEvent(room=r, generation=0, instance="d0", token_ids=[r]) for r in range(4)]
        with ch.batched():
            ch.send(addr, ev[0])
            ch.send(addr, ev[1])
            ch.flush()
            assert pull.poll(5000) and decode_all(pull.recv()) == ev[:2]
            ch.send(addr, ev[2])
            ch.send(addr, ev[3])
            assert not pull.poll(200)  # held again until the block ends
        assert pull.poll(5000) and decode_all(pull.recv()) == ev[2:]
        assert not pull.poll(200)  # nothing sent twice
        ch.flush()  # outside a batch: nothing held, nothing sent
        assert not pull.poll(100)
    finally:
        ch.close()
        pull.close(0)
        ctx.term()


def test_plain_is_asdict_without_copying_scalar_lists():
    """Messages go out through `plain` (encode's to_dict), which must equal dataclasses.asdict on
    nested messages while passing lists of scalars through uncopied."""
    import dataclasses

    from glm53.server.protocol import plain

    ids = [7, 8, 9]
    spec = RequestSpec("r1", ids, SamplingParams(temperature=0.5, logit_bias={3: 1.5}, stop=["x"]), [2])
    req = GenerateRequest(spec=spec, room=5, generation=1, prefill=PeerInfo("p", "prefill", "h", 1, 2),
                          decode=PeerInfo("d", "decode", "h", 3, None), reply_to="tcp://h:4")
    ev = TokenEvent(room=5, generation=1, instance="d", token_ids=[1, 2], transfer=TransferStats(0.5, 10, 0.1),
                    logprobs=[-0.5, -1.0], top_logprobs=[[[1, -0.5], [2, -1.5]], [[2, -1.0]]])
    for msg in (req, ev):
        assert plain(msg) == dataclasses.asdict(msg)
        assert decode(encode(msg)) == msg
    assert plain(req)["spec"]["input_ids"] is ids  # not copied
