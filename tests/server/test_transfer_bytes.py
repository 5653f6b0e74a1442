"""The bytes a decode instance reports for a request's KV transfer (the router's
`glm53:kv_transfer_bytes_total`, "MB moved"): the prompt's pages times what a page of the pools
that moved costs. The draft's pools move only with the draft KV (`draft_kv_transfer`), which the
commit record says (counts[1] = draft-context positions sent); without it they are not counted."""

from __future__ import annotations

import pytest

from glm53.server.protocol import RequestSpec
from glm53.server.sampling import SamplingParams
from tests.server.decode_double import adopt, scheduler

PS = 16  # the double's page size


@pytest.mark.parametrize("counts,per_page", [((37, 37), 1000 + 24), ((37, 0), 1000), ((37,), 1000)])
def test_bytes_count_the_draft_pools_only_when_they_moved(counts, per_page):
    sched, sent = scheduler(overlap=False)
    sched.workers.bytes_per_page, sched.workers.draft_bytes_per_page = 1000 + 24, 24
    try:
        prompt_len = 37
        params = SamplingParams(temperature=0.0, max_new_tokens=4)
        adopt(sched, RequestSpec("r0", list(range(3, 3 + prompt_len)), params, []), 0, list(counts))
        moved = [ev.transfer.bytes for ev in sent if ev.transfer is not None]
        assert moved == [3 * per_page]  # 37 prompt tokens: 3 pages of 16
    finally:
        sched.close()
