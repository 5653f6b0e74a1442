"""A prefill scheduler's requests run to their first token with recording senders instead of
transfers: `Sender` records the pages a room sends and its metadata row; `prefill` runs one
request to its first token and returns it with the pages sent, in order. Used by
test_prefix_cache.py and test_colocate_weights.py."""

from __future__ import annotations

import time

from glm53.server.engine.prefill import PrefillScheduler
from glm53.server.protocol import GenerateRequest, PeerInfo, RequestSpec
from glm53.server.sampling import SamplingParams
from glm53.transport import KVPoll


class Sender:
    """A room's senders: records what is sent, terminal once finished."""

    def __init__(self):
        self.sent, self.row, self.state = [], None, KVPoll.WAITING_FOR_INPUT

    def send_pages(self, pages, start):
        self.sent.append((list(pages), start))

    def finish(self, row):
        self.row, self.state = row, KVPoll.SUCCESS

    def poll(self):
        return self.state

    def abort(self, reason=""):
        self.state = KVPoll.FAILED


def prefill(s: PrefillScheduler, room: int, prompt: list[int]) -> tuple[int, list[int]]:
    """The request's first token and the pages it sent, in order."""
    spec = RequestSpec(f"r{room}", prompt, SamplingParams(temperature=0.0, max_new_tokens=4), [])
    s.on_request(GenerateRequest(spec=spec, room=room, generation=0, prefill=PeerInfo("p0", "prefill", "h", 1, 2),
                                 decode=PeerInfo("d0", "decode", "h", 3, None), reply_to="tcp://unused:1"))
    deadline = time.monotonic() + 120
    while (room not in s.senders or s.senders[room].row is None) and time.monotonic() < deadline:
        s.step()
    tx = s.senders[room]
    pages = [p for chunk, _ in tx.sent for p in chunk]
    assert [start for _, start in tx.sent] == [0] + [len(sum((c for c, _ in tx.sent[:i]), [])) for i in range(1, len(tx.sent))]
    return tx.row.first_token_ids[0], pages
