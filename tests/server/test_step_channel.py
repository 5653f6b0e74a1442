"""The step channel between two real rank processes (engine/step_channel.py), over both links:
every step a follower rebuilds equals what rank 0 sent (random batches: joins, leaves, appends,
replaced tables, micro-batches, draft blocks, syncs), answers come back to the step they answer,
and over shared memory an answer rank 0 never collected is dropped, not taken for the next
step's."""

from __future__ import annotations

import datetime
import random

import torch.distributed as dist
import torch.multiprocessing as mp

from glm53.server.engine.step_channel import open_follower, open_leader
from glm53.support.ports import free_ports
from tests.server.test_step_delta import _batch, _event

STEPS = 150


def _alive() -> bool:
    return True


def _rank(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    group = dist.group.WORLD
    try:
        for link in ("shm", "gloo"):
            if rank == 0:
                _lead(open_leader(group, 2, link, 20.0, _alive), link)
            else:
                _follow(open_follower(group, 1, 2, 20.0, _alive))
    finally:
        dist.destroy_process_group()


def _lead(ch, link: str) -> None:
    rng, reqs = random.Random(11), []
    for step in range(STEPS):
        for _ in range(rng.choice([0, 0, 1, 2])):
            _event(rng, reqs)
        for r in reqs:
            r.pos += 1
        mbs, spec = _batch(rng, reqs)
        ch.send(("ops", step), mbs, spec)
        if link == "shm" and step % 10 == 3:
            continue  # rank 0's part of this step "raised": its answer is never collected
        answers = ch.collect()
        assert answers[0] is None
        assert answers[1] == (("ops", step), mbs or None, spec or None), f"step {step}"
    ch.send("stop")
    assert ch.stats.steps == (STEPS - STEPS // 10 if link == "shm" else STEPS) and ch.stats.bytes_sent > 0
    ch.close()


def _follow(ch) -> None:
    while True:
        head, mbs, spec = ch.recv()
        if head == "stop":
            break
        ch.answer((head, mbs, spec))
    ch.close()


def test_both_links_deliver_every_step_and_pair_answers_with_their_step():
    # fork: the children need nothing torch set up, and a spawn would import it again (seconds)
    mp.start_processes(_rank, args=(free_ports(1)[0],), nprocs=2, join=True, start_method="fork")
