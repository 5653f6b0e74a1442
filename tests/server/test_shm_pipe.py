"""The shared-memory pipe of the control round (engine/shm_pipe.py): messages of any size (the
slot is small here, so they pass in fragments) reach every reader whole and in order; a reader
that is slow holds the writer back rather than losing a fragment; a dead peer or a timeout ends a
wait with `ChannelBroken`, never a hang. Both ends are mapped in this process, in threads."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from glm53.server.engine.shm_pipe import ChannelBroken, ShmPipe, create_file, pipe_bytes

CAP = 100  # bytes per fragment


@pytest.fixture
def path():
    p = create_file(pipe_bytes(2, CAP))
    yield p
    os.unlink(p)


def _alive() -> bool:
    return True


def test_messages_of_any_size_reach_every_reader_in_order(path):
    rng = random.Random(5)
    msgs = [b"", b"x"] + [rng.randbytes(rng.choice([1, CAP - 1, CAP, CAP + 1, 7 * CAP + 3])) for _ in range(40)]
    writer = ShmPipe(path, 0, 2, CAP)
    got: dict[int, list[bytes]] = {0: [], 1: []}

    def read(i: int) -> None:
        end = ShmPipe(path, 0, 2, CAP)
        for _ in msgs:
            got[i].append(end.read(i, 10.0, _alive))
            if i == 1 and rng.random() < 0.2:
                time.sleep(0.003)  # a slow reader: the writer must wait for it
        end.close()

    threads = [threading.Thread(target=read, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for m in msgs:
        writer.write(m, 10.0, _alive)
    for t in threads:
        t.join(10)
    writer.close()
    assert got[0] == msgs and got[1] == msgs


def test_a_dead_peer_or_a_timeout_ends_the_wait(path):
    end = ShmPipe(path, 0, 2, CAP)
    t0 = time.monotonic()
    with pytest.raises(ChannelBroken, match="peer lost"):
        end.read(0, 30.0, lambda: False)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(ChannelBroken, match="timed out"):
        end.read(0, 0.05, _alive)
    writer = ShmPipe(path, 0, 2, CAP)
    # Nobody reads: the second fragment waits for the readers' acks, then gives up.
    with pytest.raises(ChannelBroken, match="did not take"):
        writer.write(b"a" * (CAP + 1), 0.05, _alive)
    end.close()
    writer.close()
