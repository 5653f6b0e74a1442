"""Penalties, logit_bias and min_new_tokens on batched tensors (sampling.adjust_logits) and in
speculative acceptance, against a straightforward per-row, per-token reference; logprobs on the
instances (raw log_softmax, chunked prompt logprobs, the first tokens' payload) and in the
router's response shapes."""

import random

import pytest
import torch

from glm53.server.engine.logprobs import PromptLogprobs, pack_first, unpack_first
from glm53.server.engine.spec import accept
from glm53.server.sampling import (SamplingError, SamplingParams, TokenHistory, adjust_logits, sample,
                                   step_generator, token_logprobs)
from tests.server.reference_sampling import reference_adjust

V = 50


def random_case(rng: random.Random) -> tuple[SamplingParams, TokenHistory]:
    kw = {}
    if rng.random() < 0.6:
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.6:
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.6:
        kw["repetition_penalty"] = rng.uniform(0.5, 2)
    if rng.random() < 0.5:
        kw["logit_bias"] = {str(rng.randrange(V)): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 4))}
    if rng.random() < 0.5:
        kw["min_new_tokens"] = rng.randrange(0, 6)
    p = SamplingParams(temperature=0.0, **kw)
    h = TokenHistory([rng.randrange(V) for _ in range(rng.randrange(1, 8))],
                     [rng.randrange(V) for _ in range(rng.randrange(0, 8))], [rng.randrange(V), rng.randrange(V)])
    return p, h


def test_adjust_matches_reference_on_random_batches():
    rng = random.Random(0)
    for trial in range(20):
        B = rng.randrange(1, 7)
        logits = torch.randn(B, V, generator=torch.Generator().manual_seed(trial)) * 3
        cases = [random_case(rng) for _ in range(B)]
        params, hists = [c[0] for c in cases], [c[1] for c in cases]
        got = adjust_logits(logits, params, hists)
        # decode's form: the prompt as a tensor of its distinct ids gives the same logits
        as_tensor = [TokenHistory(torch.tensor(sorted(set(h.prompt))), h.output, h.stop_ids) for h in hists]
        assert torch.equal(adjust_logits(logits, params, as_tensor), got)
        for i, (p, h) in enumerate(cases):
            want = torch.tensor(reference_adjust(logits[i].tolist(), p, h))
            fin = torch.isfinite(want)
            assert torch.equal(torch.isfinite(got[i]), fin), (trial, i, p)
            assert torch.allclose(got[i][fin], want[fin], atol=1e-4), (trial, i, p)
        # greedy sampling picks the reference argmax
        toks = sample(logits, params, None, hists).tolist()
        for i, (p, h) in enumerate(cases):
            ref = reference_adjust(logits[i].tolist(), p, h)
            assert toks[i] == max(range(V), key=lambda t: (ref[t], -t))


def test_unadjusted_rows_untouched_and_history_required():
    logits = torch.randn(3, V)
    plain = [SamplingParams(temperature=0)] * 3
    assert adjust_logits(logits, plain, None) is logits
    with pytest.raises(ValueError):
        sample(logits, [SamplingParams(temperature=0, presence_penalty=1.0)] + plain[:2])


def test_min_new_tokens_masks_stop_ids_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 7] = 10.0  # eos would win
    p = SamplingParams(temperature=0, min_new_tokens=2)
    assert sample(logits, [p], None, [TokenHistory([1], [3], [7])]).item() != 7
    assert sample(logits, [p], None, [TokenHistory([1], [3, 4], [7])]).item() == 7


def test_validation_names_the_field():
    for kw, name in [({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
                     ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                     ({"logit_bias": {"1": 101}}, "logit_bias"), ({"min_new_tokens": -1}, "min_new_tokens")]:
        with pytest.raises(SamplingError) as e:
            SamplingParams(**kw)
        assert e.value.param == name
    p = SamplingParams(logit_bias={"5": 1.5})
    assert p.logit_bias == {5: 1.5} and SamplingParams.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculative_accept_applies_penalties_per_block_position(temperature):
    """A block whose drafts all match what the non-speculative sampler would emit token by token
    (each position adjusted with the tokens before it) is accepted whole; the tokens equal the
    step-by-step reference."""
    rng = random.Random(1)
    for trial in range(10):
        p, h = random_case(rng)
        p = SamplingParams(temperature=temperature, seed=trial, presence_penalty=p.presence_penalty,
                           frequency_penalty=1.5, repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias,
                           min_new_tokens=p.min_new_tokens)
        n = 4
        logits = torch.randn(n + 1, V, generator=torch.Generator().manual_seed(100 + trial)) * 2
        # step-by-step reference of the greedy/seeded-free path: greedy only can be replayed exactly
        if temperature == 0:
            out = list(h.output)
            ref = []
            for i in range(n + 1):
                row = reference_adjust(logits[i].tolist(), p, TokenHistory(h.prompt, out, h.stop_ids))
                t = max(range(V), key=lambda t: (row[t], -t))
                ref.append(t)
                out.append(t)
            got = accept(ref[:n], logits, p, first_step=len(h.output), history=h)
            assert got == ref
            # a wrong draft at position 2: the target's token there, from the adjusted row
            bad = ref[:2] + [(ref[2] + 1) % V] + ref[3:n]
            assert accept(bad, logits, p, first_step=len(h.output), history=h) == ref[:3]
        else:
            # drafts that the adjusted rows rule out (bias -100) are never accepted
            p.logit_bias = {d: -100.0 for d in range(5)}
            drafts = [0, 1, 2, 3]
            got = accept(drafts, logits, p, first_step=len(h.output), history=h)
            assert got[0] not in range(5) and len(got) == 1


def test_token_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3)) * 4
    ids = [1, 2, 3, 4]
    lps, tops = token_logprobs(logits, ids, 5)
    ref = torch.log_softmax(logits.double(), -1)
    for i, t in enumerate(ids):
        assert abs(lps[i] - ref[i, t].item()) < 1e-5
        want = ref[i].topk(5)
        assert [a for a, _ in tops[i]] == want.indices.tolist()
        assert all(abs(v - w) < 1e-5 for (_, v), w in zip(tops[i], want.values.tolist()))
    lp0, top0 = token_logprobs(logits, ids, 0)
    assert top0 == [[]] * 4 and lp0 == lps


def test_first_token_payload_roundtrip():
    lps, tops = [-0.5, -1.25], [[(3, -0.1), (4, -2.0)], [(9, -0.5), (1, -3.0)]]
    got_lp, got_top = unpack_first(pack_first(lps, tops))
    assert got_lp == lps  # exact in float32
    assert [[a for a, _ in row] for row in got_top] == [[3, 4], [9, 1]]
    assert [[v for _, v in row] for row in got_top] == [[pytest.approx(-0.1), -2.0], [-0.5, -3.0]]
    assert unpack_first(pack_first([-1.0], [[]])) == ([-1.0], [[]])


def test_prompt_logprobs_chunk_by_chunk_equal_whole():
    T = 11
    ids = [random.Random(5).randrange(V) for _ in range(T)]
    logits = torch.randn(T, V, generator=torch.Generator().manual_seed(4))
    ref = torch.log_softmax(logits.double(), -1)
    for start in (0, 1, 4, 10):
        pl = PromptLogprobs(ids, start, 2)
        for lo, hi in ((0, 3), (3, 7), (7, 11)):  # three chunks
            pl.add_chunk(logits[lo:hi], lo)
        assert len(pl.logprobs) == T - start
        for j, v in enumerate(pl.logprobs):
            q = start + j
            if q == 0:
                assert v is None and pl.tops[j] == []
            else:
                assert abs(v - ref[q - 1, ids[q]].item()) < 1e-5
                assert [a for a, _ in pl.tops[j]] == ref[q - 1].topk(2).indices.tolist()


def test_choice_generators_differ_and_choice0_is_the_n1_stream():
    a = torch.rand(4, generator=step_generator(7, 3))
    b = torch.rand(4, generator=step_generator(7, 3, choice=0))
    c = torch.rand(4, generator=step_generator(7, 3, choice=1))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_router_logprob_shapes():
    from glm53.server.router.logprobs import (Texts, chat_content, completion_logprobs, merge_completion,
                                              sglang_tokens, sglang_tops)

    class Tok:
        has_text = True

        def decode(self, ids, skip_special_tokens=True):
            return {1: "a", 2: "bc", 3: "é"}[ids[0]]

    texts = Texts(Tok())
    c = chat_content(texts, [1, 3], [-0.5, float("-inf")], [[[1, -0.5], [2, -1.0]], [[3, -2.0]]])
    assert c[0] == {"token": "a", "logprob": -0.5, "bytes": [97],
                    "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                                     {"token": "bc", "logprob": -1.0, "bytes": [98, 99]}]}
    assert c[1]["logprob"] == -9999.0 and c[1]["bytes"] == [195, 169]  # JSON has no -inf
    head = completion_logprobs(texts, [2, 1], [None, -1.0], [None, [[1, -1.0]]])
    tail = completion_logprobs(texts, [3], [-0.25], [[[3, -0.25]]], offset=3)
    m = merge_completion(head, tail)
    assert m == {"tokens": ["bc", "a", "é"], "token_logprobs": [None, -1.0, -0.25],
                 "top_logprobs": [None, {"a": -1.0}, {"é": -0.25}], "text_offset": [0, 2, 3]}
    assert sglang_tokens(texts, [1, 2], [None, -1.5]) == [[None, 1, "a"], [-1.5, 2, "bc"]]
    assert sglang_tokens(None, [1], [-1.0]) == [[-1.0, 1, None]]
    assert sglang_tops(None, [[], [[2, -0.5]]]) == [None, [[-0.5, 2, None]]]
    # vLLM's return_tokens_as_token_ids form: asked for, or a server without a tokenizer
    assert Texts(Tok(), as_ids=True)(3) == "token_id:3"
    Tok.has_text = False
    assert chat_content(Texts(Tok()), [2], [-1.0], [[[2, -1.0]]])[0]["token"] == "token_id:2"
