"""One writer, N readers, messages of any size through one shared-memory slot.

The per-step control round between the ranks of one node costs ~1.2 ms over gloo's object
collectives on the CPU VM (four collectives: size and data of the broadcast, sizes and data of
the gather; benchmarks/control_plane.py) and ~12 µs through shared memory. Modelled on vLLM's
shared-memory message queue (a written flag and one read flag per reader, waits that spin, then sleep),
cut down to what a request/response round needs: one slot, since a writer never has two
messages outstanding (it waits until every reader has taken the previous fragment before it
writes the next), and a message larger than the slot goes through it in fragments.

Layout of the mapped file: a 64-byte-aligned header `seq, total, length`, then one `ack` word
per reader (each in its own cache line, so readers do not share a line they write), then the
data. The writer writes a fragment's data, then `total` and `length`, then bumps `seq`; reader
i copies it out and sets `ack[i] = seq`. Every wait has a deadline and asks `alive()` every few
milliseconds, so a peer that died is noticed at once and one that hangs within the timeout.

The file lives in /dev/shm and is unlinked as soon as every peer has mapped it, so a process
killed at any point leaves nothing behind.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import threading
import time
from typing import Callable, Optional

_LINE = 64
_WORD = struct.Struct("q")
_HEAD = struct.Struct("qqq")  # seq, total, length
_SIZES = struct.Struct("qq")  # total, length: written before seq publishes them
# Waits spin (yielding the core) this long, then sleep with a doubling interval up to the cap,
# and after IDLE_S sleep IDLE_SLEEP_S at a time: an answer comes within microseconds of the
# peer's forward; the next step comes after rank 0's host work between steps (sampling, commits:
# milliseconds on a CPU), which a wake-up then trails by at most the cap; an idle instance's next
# step may be far away and must not cost a core.
SPIN_S = 2e-3
SLEEP_CAP_S = 2e-4
IDLE_S = 0.05
IDLE_SLEEP_S = 1e-3
ALIVE_EVERY_S = 5e-3

_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier (taking a lock is one), so the data is visible before the flag
    that publishes it — as vLLM does; on x86 stores are ordered anyway, on Arm they are not."""
    with _fence_lock:
        pass


class ChannelBroken(RuntimeError):
    """A peer died, or did not answer within the timeout."""


def create_file(size: int) -> str:
    """A new zero-filled file of `size` bytes in /dev/shm (else the temp dir); its path."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="glm53-ctl-", dir=base)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return path


def pipe_bytes(n_readers: int, capacity: int) -> int:
    return _data_offset(n_readers) + capacity


def _data_offset(n_readers: int) -> int:
    return _LINE * (1 + n_readers)


class ShmPipe:
    """One end of a pipe mapped from `path` at `offset` (several pipes may share a file)."""

    def __init__(self, path: str, offset: int, n_readers: int, capacity: int):
        self.n_readers, self.capacity = n_readers, capacity
        self._size = pipe_bytes(n_readers, capacity)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, offset + self._size)
        finally:
            os.close(fd)
        self._buf = memoryview(self._map)[offset : offset + self._size]
        self._data = _data_offset(n_readers)
        self._seq = 0  # the last fragment this end wrote (writer) or took (reader)

    def close(self) -> None:
        self._buf.release()
        try:
            self._map.close()
        except BufferError:  # a view still exported: the mapping goes with the process
            pass

    # -- writer ------------------------------------------------------------------------------
    def write(self, payload: bytes, timeout_s: float, alive: Callable[[], bool]) -> None:
        view = memoryview(payload)
        total, o = len(view), 0
        while True:
            n = min(self.capacity, total - o)
            self._wait_acks(self._seq, timeout_s, alive)  # every reader took the previous fragment
            self._buf[self._data : self._data + n] = view[o : o + n]
            _SIZES.pack_into(self._buf, _WORD.size, total, n)
            _fence()
            self._seq += 1
            _WORD.pack_into(self._buf, 0, self._seq)
            o += n
            if o >= total:
                return

    def _wait_acks(self, seq: int, timeout_s: float, alive: Callable[[], bool]) -> None:
        for i in range(self.n_readers):
            off = _LINE * (1 + i)
            _wait(lambda: _WORD.unpack_from(self._buf, off)[0] >= seq, timeout_s, alive,
                  f"reader {i} did not take message fragment {seq}")

    # -- reader ------------------------------------------------------------------------------
    def read(self, reader: int, timeout_s: Optional[float], alive: Callable[[], bool]) -> bytes:
        """The next message, whole. `timeout_s` None: wait as long as `alive()` holds."""
        out: Optional[bytearray] = None
        ack = _LINE * (1 + reader)
        while True:
            want = self._seq + 1
            _wait(lambda: _WORD.unpack_from(self._buf, 0)[0] >= want, timeout_s, alive,
                  f"no message fragment {want} from the writer")
            _fence()
            _, total, n = _HEAD.unpack_from(self._buf, 0)
            if out is None:
                out = bytearray()
            out += self._buf[self._data : self._data + n]
            self._seq = want
            _fence()
            _WORD.pack_into(self._buf, ack, want)
            if len(out) >= total:
                return bytes(out)


def _wait(ready: Callable[[], bool], timeout_s: Optional[float], alive: Callable[[], bool], what: str) -> None:
    if ready():
        return
    t0 = time.monotonic()
    deadline = None if timeout_s is None else t0 + timeout_s
    next_alive = t0 + ALIVE_EVERY_S
    sleep = 5e-5
    while not ready():
        now = time.monotonic()
        if now >= next_alive:
            if not alive():
                raise ChannelBroken(f"peer lost: {what}")
            next_alive = now + ALIVE_EVERY_S
        if deadline is not None and now >= deadline:
            raise ChannelBroken(f"timed out after {timeout_s:.0f} s: {what}")
        waited = now - t0
        if waited < SPIN_S:
            os.sched_yield()
        else:
            time.sleep(sleep)
            sleep = min(2 * sleep, SLEEP_CAP_S) if waited < IDLE_S else IDLE_SLEEP_S
