"""The per-step control round of an instance's rank processes: rank 0 sends a step, every
follower answers.

A step goes out as `(head, BatchDelta)` pickled — `head` is the transfer operations and page
copies queued since the last step (engine/processes.py's `Command`, minus its batch), the delta
is the batch as engine/step_delta.py encodes it: only what changed. Each follower's answer (its
transfer states, the last stage's results, its stage statistics) comes back pickled, tagged with
the step it answers, so an answer rank 0 never collected (its own part of that step raised) is
dropped instead of being taken for the next step's.

Two links carry the bytes:

- `ShmLink` (ranks of one node; the default): one `ShmPipe` for the steps (every follower
  reads it) and one per follower for its answers, in one file in /dev/shm;
- `GlooLink`: the control group's object collectives (a broadcast, then a gather), for ranks
  that share no memory (an instance spanning nodes).

Which one an instance uses is rank 0's choice, sent to the followers once at start-up over the
control group (`open_leader` / `open_follower`), so nothing else of the launch changes. Every
wait is bounded: a follower waits for a step at most `timeout_s` (rank 0 of a live instance
sends one at least every scheduler loop), rank 0 waits for an answer at most `timeout_s` and
notices a dead follower within milliseconds (`alive`); both raise `ChannelBroken`, a
`RuntimeError` like the ones gloo raises, so the group reports the rank lost.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from glm53.server.engine.shm_pipe import ChannelBroken, ShmPipe, create_file, pipe_bytes
from glm53.server.engine.step_delta import BatchDelta, DeltaDecoder, DeltaEncoder

__all__ = ["ChannelBroken", "ControlStats", "LeaderChannel", "FollowerChannel", "open_leader", "open_follower"]

# A step's delta and queued operations fit easily; a larger message (a prefill step's prompt
# tokens, a pipeline's last-stage logits) passes in fragments.
STEP_CAPACITY = 1 << 20
ANSWER_CAPACITY = 1 << 20
LINKS = ("shm", "gloo")


@dataclass
class ControlStats:
    """Rank 0's control rounds, cumulative: time to encode and hand over each step, time until
    every answer is in and read (the peers' own step work included: they answer after their
    forward), and the bytes both ways."""

    steps: int = 0
    send_s: float = 0.0
    collect_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0

    def reset(self) -> None:
        self.steps, self.send_s, self.collect_s, self.bytes_sent, self.bytes_received = 0, 0.0, 0.0, 0, 0


class GlooLink:
    """Steps and answers as object collectives on the control group (works across nodes)."""

    def __init__(self, group: dist.ProcessGroup, world: int):
        self.group, self.world = group, world

    def send(self, payload: bytes) -> None:
        dist.broadcast_object_list([payload], src=0, group=self.group)

    def recv(self) -> bytes:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def answer(self, payload: bytes) -> None:
        dist.gather_object(payload, None, dst=0, group=self.group)

    def collect_each(self) -> list[tuple[int, bytes]]:
        out: list[Any] = [None] * self.world
        dist.gather_object(b"", out, dst=0, group=self.group)
        return list(enumerate(out))[1:]

    def read_answer(self, rank: int) -> bytes:
        # A gather pairs every rank's calls in order: no answer is ever left behind on gloo.
        raise ChannelBroken(f"rank {rank} answered an earlier step")

    def close(self) -> None:
        pass


class ShmLink:
    """Steps and answers through shared memory (ranks of one node). Rank 0 creates the file;
    `rank` is this end's rank in the instance."""

    def __init__(self, path: str, rank: int, world: int, timeout_s: float, alive: Callable[[], bool]):
        self.rank, self.world, self.timeout_s, self.alive = rank, world, timeout_s, alive
        readers = world - 1
        self.steps = ShmPipe(path, 0, readers, STEP_CAPACITY)
        base = _round_up(pipe_bytes(readers, STEP_CAPACITY))
        stride = _round_up(pipe_bytes(1, ANSWER_CAPACITY))
        # answers[r]: follower r's pipe; rank 0 maps them all, a follower only its own.
        self.answers = {r: ShmPipe(path, base + (r - 1) * stride, 1, ANSWER_CAPACITY)
                        for r in range(1, world) if rank in (0, r)}

    @staticmethod
    def file_bytes(world: int) -> int:
        return _round_up(pipe_bytes(world - 1, STEP_CAPACITY)) + (world - 1) * _round_up(pipe_bytes(1, ANSWER_CAPACITY))

    def send(self, payload: bytes) -> None:
        self.steps.write(payload, self.timeout_s, self.alive)

    def recv(self) -> bytes:
        return self.steps.read(self.rank - 1, self.timeout_s, self.alive)

    def answer(self, payload: bytes) -> None:
        self.answers[self.rank].write(payload, self.timeout_s, self.alive)

    def collect_each(self) -> list[tuple[int, bytes]]:
        return [(r, self.read_answer(r)) for r in range(1, self.world)]

    def read_answer(self, rank: int) -> bytes:
        return self.answers[rank].read(0, self.timeout_s, self.alive)

    def close(self) -> None:
        for p in (self.steps, *self.answers.values()):
            p.close()


def _round_up(n: int, to: int = 4096) -> int:
    return -(-n // to) * to


class LeaderChannel:
    """Rank 0's end."""

    def __init__(self, link, stats: Optional[ControlStats] = None):
        self.link = link
        self.encoder = DeltaEncoder()
        self.stats = stats if stats is not None else ControlStats()
        self.step = 0  # steps sent; answers carry the step they answer

    def send(self, head: Any, microbatches=None, spec=None) -> None:
        t0 = time.perf_counter()
        self.step += 1
        payload = pickle.dumps((self.step, head, self.encoder.encode(microbatches, spec)),
                               protocol=pickle.HIGHEST_PROTOCOL)
        self.link.send(payload)
        self.stats.send_s += time.perf_counter() - t0
        self.stats.bytes_sent += len(payload)

    def collect(self) -> list[Any]:
        """Every follower's answer, by rank (rank 0's entry is None)."""
        t0 = time.perf_counter()
        out: list[Any] = [None] * self.link.world
        for rank, b in self.link.collect_each():
            step, obj = pickle.loads(b)
            # An answer to an earlier step that rank 0 never collected (its own part of that step
            # raised) is stale: the follower's answer to this step is next.
            while step < self.step:
                b = self.link.read_answer(rank)
                step, obj = pickle.loads(b)
            out[rank] = obj
            self.stats.bytes_received += len(b)
        self.stats.collect_s += time.perf_counter() - t0
        self.stats.steps += 1
        return out

    def close(self) -> None:
        self.link.close()


class FollowerChannel:
    """A follower's end: the steps, rebuilt from their deltas; its answers."""

    def __init__(self, link):
        self.link = link
        self.decoder = DeltaDecoder()
        self.step = 0

    def recv(self) -> tuple[Any, Optional[list], Optional[list]]:
        """(head, micro-batches, draft blocks) of the next step."""
        self.step, head, delta = pickle.loads(self.link.recv())
        if not isinstance(delta, BatchDelta):
            raise RuntimeError(f"step channel: expected a BatchDelta, got {type(delta).__name__}")
        return (head, *self.decoder.decode(delta))

    def answer(self, obj: Any) -> None:
        self.link.answer(pickle.dumps((self.step, obj), protocol=pickle.HIGHEST_PROTOCOL))

    def close(self) -> None:
        self.link.close()


def open_leader(control: dist.ProcessGroup, world: int, link: str, timeout_s: float,
                alive: Callable[[], bool]) -> LeaderChannel:
    """Rank 0: make the link and tell the followers (one collective on the control group). The
    shared-memory file is unlinked once every follower has mapped it: a crash leaves nothing."""
    if link not in LINKS:
        raise ValueError(f"control link must be one of {LINKS}, got {link!r}")
    path = create_file(ShmLink.file_bytes(world)) if link == "shm" else None
    try:
        dist.broadcast_object_list([(link, path)], src=0, group=control)
        made = ShmLink(path, 0, world, timeout_s, alive) if path else GlooLink(control, world)
        dist.barrier(group=control)  # every follower has its mapping
    finally:
        if path:
            os.unlink(path)
    return LeaderChannel(made)


def open_follower(control: dist.ProcessGroup, rank: int, world: int, timeout_s: float,
                  alive: Callable[[], bool]) -> FollowerChannel:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    link, path = box[0]
    made = ShmLink(path, rank, world, timeout_s, alive) if link == "shm" else GlooLink(control, world)
    dist.barrier(group=control)
    return FollowerChannel(made)
