"""n > 1 choices in the decode scheduler: the prompt's full pages are held once for all choices,
each choice gets its own pages from the prompt's partial last page on (a copy of that page), and
the shared pages are freed with the last choice, whichever order the choices end in. Through the
worker double of decode_double.py (its steps assert they never write a free page); the real
model's n > 1 outputs are checked end to end in tests/e2e/test_api.py."""

from __future__ import annotations

import pytest

from glm53.server.engine.decode_request import DecodeRequest
from glm53.server.protocol import GenerateRequest, PeerInfo, RequestSpec
from glm53.server.sampling import SamplingParams
from tests.server.decode_double import adopt, reference_tokens, scheduler

PS = 16  # the double's page size


def adopt_choices(sched, room: int, prompt_len: int, max_new: int, n: int) -> list[DecodeRequest]:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    spec = RequestSpec(f"r{room}", list(range(3, 3 + prompt_len)), params, [], n=n)
    r = adopt(sched, spec, room, [prompt_len])
    return [c for c in sched.running if c.key == r.key]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("prompt_len", [37, 32])  # a partial last prompt page, and none
def test_choices_share_the_prompt_pages_and_free_them_with_the_last(overlap, prompt_len):
    sched, sent = scheduler(overlap)
    copies = []
    sched.workers.copy_pages = lambda src, dst: copies.append((list(src), list(dst)))
    try:
        max_new, n = 20, 3
        full, per = prompt_len // PS, -(-(prompt_len + max_new) // PS)
        choices = adopt_choices(sched, 1, prompt_len, max_new, n)
        assert [c.index for c in choices] == [0, 1, 2]
        # the full prompt pages once, then each choice's own: fewer pages than n whole copies
        used = sched.allocator.num_pages - sched.allocator.num_free
        assert used == full + n * (per - full) < n * per
        heads = {tuple(c.pages[:full]) for c in choices}
        assert len(heads) == 1 and all(len(c.pages) == per for c in choices)
        owns = [set(c.pages[full:]) for c in choices]
        assert not (owns[0] & owns[1]) and not (owns[0] & owns[2]) and not (owns[1] & owns[2])
        if prompt_len % PS:
            assert copies == [([choices[0].pages[full]], [c.pages[full]]) for c in choices[1:]]
        else:
            assert copies == []
        steps = 0
        while sched.running or sched.inflight is not None:
            if steps == 4:  # choice 1 ends first (as its own stop string would): only its own pages go back
                free = sched.allocator.num_free
                sched._release(choices[1])
                if sched.inflight is None:
                    assert sched.allocator.num_free == free + per - full
                assert all(sched.allocator._used[p] for p in choices[0].pages[:full])
            sched._decode()
            steps += 1
            assert steps < 100
        assert sched.allocator.num_free == sched.allocator.num_pages
        out: dict[int, list[int]] = {}
        for ev in sent:
            out.setdefault(ev.index, []).extend(ev.token_ids)
        want = reference_tokens(prompt_len, max_new)
        assert out[0] == want and out[2] == want  # greedy: every choice is the n = 1 answer
        assert out[1] == want[: len(out[1])] and len(out[1]) < max_new
    finally:
        sched.close()


def test_admission_counts_the_shared_pages():
    sched, _ = scheduler(False)
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=16)
        spec = RequestSpec("r", list(range(3, 3 + 100)), params, [], n=4)  # 6 full pages + 1 partial
        req = GenerateRequest(spec=spec, room=1, generation=0, prefill=PeerInfo("p0", "prefill", "h", 1, 2),
                              decode=PeerInfo("d0", "decode", "h", 3, None), reply_to="tcp://unused:1")
        assert sched._request_pages(req) == 6 + 4 * (8 - 6)
        spec.n = 1
        assert sched._request_pages(req) == 8
    finally:
        sched.close()
