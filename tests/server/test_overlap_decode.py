"""The overlapped decode loop (engine/overlap.py) against the synchronous one, through a worker
double whose greedy token is a known function of the step's input token and position: a step
fed the wrong device-side input, or at the wrong position, changes everything after it. Checked:
outputs and events equal to the synchronous loop for a batch with different lengths, stop
tokens and joins; nothing committed past a stop; pages of a row still in an in-flight step never
free; an abort while in flight; a non-plain row (logprobs) draining the pipeline; all pages back.
The real model's device-side inputs (eager and CUDA graphs) are tested in tests/models and on
the GPU, and every e2e test decodes through this loop. (The double: decode_double.py.)"""

from __future__ import annotations

from glm53.server.engine.decode import DecodeScheduler
from glm53.server.engine.decode_request import DecodeRequest
from glm53.server.protocol import Abort, GenerateRequest, PeerInfo, RequestSpec
from glm53.server.sampling import SamplingParams
from tests.server.decode_double import next_token, reference_tokens, scheduler


def adopt(sched: DecodeScheduler, room: int, prompt_len: int, max_new: int, stop=(), logprobs: int = -1,
          **sampling):
    params = SamplingParams(**{"temperature": 0.0, **sampling}, max_new_tokens=max_new, stop_token_ids=list(stop))
    spec = RequestSpec(f"r{room}", list(range(3, 3 + prompt_len)), params, [], logprobs=logprobs)
    req = GenerateRequest(spec=spec, room=room, generation=0, prefill=PeerInfo("p0", "prefill", "h", 1, 2),
                          decode=PeerInfo("d0", "decode", "h", 3, None), reply_to="tcp://unused:1")
    r = DecodeRequest(req, arrived=0.0, pages=sched.allocator.alloc(sched.workers.pages_needed(prompt_len + max_new)))
    first = next_token(prompt_len - 1, 3 + prompt_len - 1)
    lp = ([-0.5], [[]]) if logprobs >= 0 else (None, None)
    sched._commit(r, [first], *lp, first=True)
    return r


def outputs(sent) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for ev in sent:
        out.setdefault(ev.room, []).extend(ev.token_ids)
    return out


def check_in_flight_pages(sched: DecodeScheduler) -> None:
    """Every page the step in flight (the double's last forward) writes is still allocated."""
    if sched.inflight is not None:
        for _, _, pages in sched.workers.steps[-1]:
            assert all(sched.allocator._used[p] for p in pages), "an in-flight row's pages were freed"


def run_script(overlap: bool, abort_room: int | None = None):
    """Three requests, a fourth joining at step 3 (with a stop token it meets), optionally an
    abort at step 4; decode to the end."""
    sched, sent = scheduler(overlap)
    try:
        adopt(sched, 1, 20, 12)
        adopt(sched, 2, 33, 5)
        adopt(sched, 3, 7, 9)
        steps = 0
        while sched.running or sched.inflight is not None:
            if steps == 3:
                want = reference_tokens(40, 30)
                adopt(sched, 4, 40, 30, stop=[want[6]])
            if steps == 4 and abort_room is not None:
                sched.on_abort(Abort(room=abort_room, generation=0, reason="client gone"))
            sched._decode()
            check_in_flight_pages(sched)
            steps += 1
            assert steps < 100
        assert sched.allocator.num_free == sched.allocator.num_pages
        return outputs(sent), [ev.finish_reason for ev in sent if ev.finish_reason], sched.workers.routed
    finally:
        sched.close()


def test_overlapped_equals_synchronous():
    sync_out, sync_reasons, _ = run_script(overlap=False)
    out, reasons, routed = run_script(overlap=True)
    assert out == sync_out and sorted(reasons) == sorted(sync_reasons)
    assert out[1] == reference_tokens(20, 12) and out[3] == reference_tokens(7, 9)
    want4 = reference_tokens(40, 30)
    assert out[4] == want4[:7]  # ends at its stop token, nothing after it
    # the chain of next_token above holds only if every device-side input was routed right
    assert routed > 0


def test_abort_while_in_flight():
    sync_out, _, _ = run_script(overlap=False, abort_room=1)
    out, reasons, _ = run_script(overlap=True, abort_room=1)
    assert out[2] == sync_out[2] and out[3] == sync_out[3] and out[4] == sync_out[4]
    # the aborted request streamed a prefix of its greedy output and nothing else
    assert out[1] == reference_tokens(20, 12)[: len(out[1])]


def test_a_row_with_logprobs_drains_the_pipeline():
    sched, sent = scheduler(True)
    try:
        adopt(sched, 1, 10, 6)
        sched._decode()
        assert sched.inflight is not None  # plain: overlapped
        adopt(sched, 2, 12, 4, logprobs=0)
        sched._decode()  # a logprobs row: the in-flight step is read back first, then a synchronous step
        assert sched.inflight is None
        while sched.running or sched.inflight is not None:
            sched._decode()
        out = outputs(sent)
        assert out[1] == reference_tokens(10, 6) and out[2] == reference_tokens(12, 4)
        assert all(len(ev.logprobs) == len(ev.token_ids) for ev in sent if ev.room == 2)
        assert sched.allocator.num_free == sched.allocator.num_pages
    finally:
        sched.close()


def test_unseeded_sampled_rows_overlap_and_seeded_ones_drain():
    """Sampled rows without a seed overlap (drawn on the device by the sampler); a seeded one
    draws its noise on the host, so it runs synchronously. The double's logits are so peaked that
    at temperature 0.05 every draw is its greedy token: the outputs are the greedy chains."""
    sched, sent = scheduler(True)
    try:
        adopt(sched, 1, 10, 8, temperature=0.05, top_k=5, top_p=0.9)
        sched._decode()
        assert sched.inflight is not None
        adopt(sched, 2, 12, 5, temperature=0.05, seed=7)
        sched._decode()
        assert sched.inflight is None  # the seeded row drained the pipeline
        while sched.running or sched.inflight is not None:
            sched._decode()
        out = outputs(sent)
        assert out[1] == reference_tokens(10, 8) and out[2] == reference_tokens(12, 5)
        assert sched.workers.routed > 0
    finally:
        sched.close()


def test_an_adopted_first_token_leaves_before_the_steps_decode():
    """A step that adopts requests flushes their first tokens before its decode runs (with a
    draft, a whole verify of the block), so that decode's time is no part of their TTFT."""
    for overlap in (False, True):
        sched, _ = scheduler(overlap)
        try:
            log = []
            sched.channel.send = lambda _to, ev: log.append(("event", tuple(ev.token_ids)))
            sched.channel.flush = lambda: log.append(("flush",))
            adopted = []

            def poll_transfers():  # the first step adopts one request, later ones nothing
                if adopted:
                    return False
                adopted.append(adopt(sched, 1, 20, 4))
                return True

            sched._poll_transfers = poll_transfers
            sched.step()
            while sched.running or sched.inflight is not None:
                sched.step()  # adopts nothing more: nothing flushed early
            want = reference_tokens(20, 4)
            # the first token, flushed; then what the decode steps committed, after the flush
            assert log == [("event", (want[0],)), ("flush",)] + [("event", (t,)) for t in want[1:]]
        finally:
            sched.close()
