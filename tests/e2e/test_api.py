"""The API surface of issue 18 through the real PD pipeline (router -> prefill -> NIXL -> decode,
embedded tiny model, one cluster for the module): logprobs against the reference model's
log_softmax, n > 1 sharing one prefill, penalties / logit_bias / min_tokens against a reference
sampler, /generate field acceptance and batch form, error params; the `openai` SDK parses every
shape (stream and not)."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import openai
import pytest

from glm53.models import ModelRunner
from glm53.server.embedded_model import ensure_embedded_model
from glm53.server.sampling import SamplingParams
from tests.e2e import structured_checks
from tests.e2e.reference import TOL, ref_logsoftmax, reference_greedy
from tests.e2e.served import wait_pages_free

MODEL = "glm-5-tiny"
PROMPT = [11, 42, 7, 99, 3, 250, 17, 64, 5, 8, 120, 33]


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def runner(model_cache):
    return ModelRunner.from_dir(ensure_embedded_model(model_cache), num_pages=64, progress=False)


def generate(cluster, body: dict, status: int = 200):
    r = httpx.post(f"{cluster.url}/generate", json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def test_generate_logprobs_equal_reference(cluster, runner):
    out = generate(cluster, {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                             "top_logprobs_num": 3, "return_text_in_logprobs": True,
                             "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    ids = out["output_ids"]
    meta = out["meta_info"]
    ref = ref_logsoftmax(runner, PROMPT + ids)
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(PROMPT) and inp[0][0] is None and [t for _, t, _ in inp] == PROMPT
    for q in range(1, len(PROMPT)):
        assert abs(inp[q][0] - ref[q - 1, PROMPT[q]].item()) < TOL
        assert [t for _, t, _ in meta["input_top_logprobs"][q]] == ref[q - 1].topk(3).indices.tolist()
    outp = meta["output_token_logprobs"]
    assert [t for _, t, _ in outp] == ids
    for j, (lp, tid, text) in enumerate(outp):
        row = ref[len(PROMPT) - 1 + j]
        assert abs(lp - row[tid].item()) < TOL and isinstance(text, str)
        top = meta["output_top_logprobs"][j]
        assert top[0][1] == tid and abs(top[0][0] - lp) < 1e-6  # greedy: the top token
    # logprob_start_len -1 (what bench_serving sends): output logprobs only
    out2 = generate(cluster, {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": -1,
                              "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert out2["meta_info"]["input_token_logprobs"] == []
    assert [x[0] for x in out2["meta_info"]["output_token_logprobs"]] == pytest.approx([x[0] for x in outp], abs=1e-5)
    assert all(x[2] is None for x in out2["meta_info"]["output_token_logprobs"])
    # requests with different top counts decode in one batch, each with its own count
    with cf.ThreadPoolExecutor(3) as ex:
        outs = list(ex.map(lambda k: generate(cluster, {
            "input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": k,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}), (0, 1, 4)))
    assert "output_top_logprobs" not in outs[0]["meta_info"]
    assert {len(t) for t in outs[1]["meta_info"]["output_top_logprobs"]} == {1}
    assert {len(t) for t in outs[2]["meta_info"]["output_top_logprobs"]} == {4}
    assert all(o["output_ids"][:6] == ids for o in outs)
    # a request that does not ask gets none
    assert "output_token_logprobs" not in generate(cluster, {"input_ids": PROMPT,
                                                             "sampling_params": {"max_new_tokens": 2}})["meta_info"]


def test_bench_serving_request_body(cluster):
    """The body SGLang's bench_serving (backend sglang, --return-logprob) sends, streamed: every
    event parses and the last has one output logprob per generated token."""
    body = {"text": "Hello there, how are", "sampling_params": {"temperature": 0.0, "max_new_tokens": 8,
                                                                "ignore_eos": True},
            "stream": True, "lora_path": None, "return_logprob": True, "return_routed_experts": False,
            "logprob_start_len": -1}
    with httpx.stream("POST", f"{cluster.url}/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == 8
    lps = last["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == last["output_ids"] and all(lp <= 0 for lp, _, _ in lps)


def test_openai_logprobs_shapes_and_values(cluster, runner):
    c = client(cluster)
    # best_of 1 (what bench_serving's OpenAI backends send) is n's default
    comp = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, echo=True,
                                best_of=1)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) + 5 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ids = PROMPT + generate(cluster, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
                            )["output_ids"]
    ref = ref_logsoftmax(runner, ids)
    for q in range(1, len(ids)):
        assert abs(lp.token_logprobs[q] - ref[q - 1, ids[q]].item()) < TOL
        # the top 2, and the token itself when it is not among them
        assert lp.tokens[q] in lp.top_logprobs[q] and 2 <= len(lp.top_logprobs[q]) <= 3
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # echo + max_tokens 0: prompt scoring
    score = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    assert score.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:len(PROMPT)], abs=1e-5)
    # streamed completions carry the same logprobs
    streamed = [x for x in c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                                stream=True) if x.choices and x.choices[0].logprobs]
    got = [v for x in streamed for v in x.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx(lp.token_logprobs[len(PROMPT):], abs=1e-5)
    # streamed, n = 2, echo: each choice starts with the prompt and its logprobs
    per: dict[int, list] = {0: [], 1: []}
    for x in c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, echo=True,
                                  n=2, stream=True, stream_options={"include_usage": True}):
        for ch in x.choices:
            per[ch.index].extend(ch.logprobs.token_logprobs if ch.logprobs else [])
        if x.usage:
            assert x.usage.completion_tokens == 10
    assert per[0] == per[1] == pytest.approx(lp.token_logprobs, abs=1e-5)

    msgs = [{"role": "user", "content": "Count to five."}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                     top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert all(abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6 for t in content)  # greedy picks the top
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=3, stream=True))
    streamed_lp = [t.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                   for t in ch.choices[0].logprobs.content]
    assert streamed_lp == pytest.approx([t.logprob for t in content], abs=1e-5)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=msgs, top_logprobs=3)  # needs logprobs
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="x", logprobs=6)


def test_completion_top_logprobs_hold_the_sampled_token(cluster):
    """OpenAI and vLLM: `top_logprobs` always holds the sampled token, also when it is not among
    the top N (N + 1 entries), and `logprobs: 0` gives just that token. logit_bias forces a token
    the raw logits (which logprobs report) do not rank first."""
    c = client(cluster)
    forced = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1)
    top1 = forced.choices[0].logprobs.tokens[0]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={"77": 100.0})
    for k in (0, 1, 3):
        for streamed in (False, True):
            if streamed:
                lps = [x.choices[0].logprobs for x in c.completions.create(logprobs=k, stream=True, **kw)
                       if x.choices and x.choices[0].logprobs]
                tokens = [t for lp in lps for t in lp.tokens]
                values = [v for lp in lps for v in lp.token_logprobs]
                tops = [t for lp in lps for t in lp.top_logprobs]
            else:
                lp = c.completions.create(logprobs=k, **kw).choices[0].logprobs
                tokens, values, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
            assert len(tokens) == len(tops) == 4
            for tok, v, top in zip(tokens, values, tops):
                assert top[tok] == pytest.approx(v) and len(top) <= k + 1, (k, top)
                if k == 0:
                    assert top == {tok: v}
            # the first token is the biased one, not the model's top-1: it is there beside the top N
            if k:
                assert tokens[0] != top1 and top1 in tops[0] and len(tops[0]) == k + 1, (tokens[0], top1, tops[0])


def test_forced_tool_call_cut_off_by_max_tokens_stays_content(cluster):
    """A call cut off before its </tool_call> is not a call: its markup stays content with
    finish_reason "length" (as vLLM's parser leaves it); streamed, the pieces that went out stay
    out and finish_reason "length" marks the last call incomplete."""
    c = client(cluster)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL, messages=msgs, tools=structured_checks.TOOLS, tool_choice=named, temperature=0,
              extra_body=structured_checks.NOTHINK)
    for max_tokens in (3, 14):  # in the name; in the arguments (the case that came back as a call)
        r = c.chat.completions.create(max_tokens=max_tokens, **kw)
        ch = r.choices[0]
        assert ch.finish_reason == "length" and not ch.message.tool_calls, r
        assert ch.message.content.startswith("<tool_call>get_"), ch.message.content
    assert "<arg_value>" in ch.message.content, ch.message.content
    chunks = list(c.chat.completions.create(max_tokens=14, stream=True, **kw))
    assert chunks[-1].choices[0].finish_reason == "length"
    full = c.chat.completions.create(max_tokens=64, **kw).choices[0]
    assert full.finish_reason == "tool_calls"
    structured_checks.check_call(full.message.tool_calls[0], ("get_weather",))


def test_n_choices_share_one_prefill(cluster):
    c = client(cluster)
    msgs = [{"role": "user", "content": "Tell me a story."}]
    # greedy: every choice equals the n=1 answer (the copied prompt KV is the prefill's)
    one = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    many = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, n=3)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert all(ch.message.content == one.choices[0].message.content for ch in many.choices)
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens
    # seeded sampling: deterministic per choice, choice 0 is the n=1 stream, choices differ
    kw = dict(model=MODEL, messages=msgs, max_tokens=10, temperature=1.0, seed=1234)
    a = c.chat.completions.create(n=3, **kw)
    b = c.chat.completions.create(n=3, **kw)
    assert [x.message.content for x in a.choices] == [x.message.content for x in b.choices]
    assert c.chat.completions.create(n=1, **kw).choices[0].message.content == a.choices[0].message.content
    assert len({x.message.content for x in a.choices}) > 1
    # streamed: per-choice deltas and finish reasons
    texts, finishes = {}, {}
    for ch in c.chat.completions.create(n=3, stream=True, **kw):
        for x in ch.choices:
            texts[x.index] = texts.get(x.index, "") + (x.delta.content or "")
            if x.finish_reason:
                finishes[x.index] = x.finish_reason
    assert [texts[i] for i in range(3)] == [x.message.content for x in a.choices] and len(finishes) == 3
    # a stop string that ends choice 0 only: choice 0 is aborted on decode alone, choice 1 goes on
    kw2 = dict(model=MODEL, messages=msgs, max_tokens=12, temperature=1.0, seed=99, n=2,
               extra_body={"ignore_eos": True})
    free = c.chat.completions.create(**kw2)
    t0, t1 = free.choices[0].message.content, free.choices[1].message.content
    stop = next(t0[i:i + 2] for i in range(1, len(t0) - 1) if t0[i:i + 2] not in t1 and t0[i:i + 2].strip())
    cut = c.chat.completions.create(stop=[stop], **kw2)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == t0[: t0.index(stop)]
    assert cut.choices[1].finish_reason == "length" and cut.choices[1].message.content == t1
    # completions: two prompts x n=2, OpenAI's index order
    comp = c.completions.create(model=MODEL, prompt=["one two", "three four"], max_tokens=4, temperature=0, n=2)
    assert [x.index for x in comp.choices] == [0, 1, 2, 3]
    assert comp.choices[0].text == comp.choices[1].text and comp.choices[2].text == comp.choices[3].text
    # /generate: n=2 answers a list
    g = generate(cluster, {"text": "hello", "sampling_params": {"n": 2, "max_new_tokens": 3, "temperature": 0}})
    assert isinstance(g, list) and len(g) == 2 and g[0]["output_ids"] == g[1]["output_ids"]
    # best_of: the most likely of best_of seeded choices (summed logprobs), which are n=3's
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    three = c.completions.create(n=3, logprobs=0, **kw)
    best = max(three.choices, key=lambda x: sum(x.logprobs.token_logprobs))
    picked = c.completions.create(n=1, best_of=3, **kw)
    assert len(picked.choices) == 1 and picked.choices[0].text == best.text and picked.choices[0].logprobs is None
    assert picked.usage.completion_tokens == three.usage.completion_tokens  # all three were generated
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="x", n=2, best_of=1)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="x", n=1, best_of=2, stream=True)
    wait_pages_free(cluster)


def test_penalties_logit_bias_min_tokens_equal_reference(cluster, runner):
    cases = [{"frequency_penalty": 1.5, "presence_penalty": 0.5},
             {"repetition_penalty": 1.8},
             {"logit_bias": {"77": 8.0, "5": -50.0}, "presence_penalty": -0.5}]
    for kw in cases:
        sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}
        got = generate(cluster, {"input_ids": PROMPT, "sampling_params": sp})["output_ids"]
        want = reference_greedy(runner, PROMPT, SamplingParams(temperature=0, **kw), [], 8)
        assert got == want, kw
    # OpenAI names: min_tokens holds back a stop token the greedy model would emit at once
    first = generate(cluster, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
                     )["output_ids"][0]
    c = client(cluster)
    short = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                 extra_body={"stop_token_ids": [first], "ignore_eos": True})
    assert short.usage.completion_tokens == 1 and short.choices[0].finish_reason == "stop"
    held = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={
        "stop_token_ids": [first], "min_tokens": 4, "ignore_eos": True})
    assert held.usage.completion_tokens >= 4
    biased = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={"123": 100})
    assert generate(cluster, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                       "logit_bias": {"123": 100}}}
                    )["output_ids"] == [123] * 4
    assert biased.usage.completion_tokens == 4
    e = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "x", "logit_bias": {"9999999": 1}}).json()
    assert e["error"]["param"] == "logit_bias"
    e = httpx.post(f"{cluster.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                "presence_penalty": 3}).json()
    assert e["error"]["param"] == "presence_penalty"


def test_generate_fields_batch_and_error_params(cluster):
    # SGLang clients' defaults are accepted
    ok = generate(cluster, {"text": "hi", "sampling_params": {
        "max_new_tokens": 2, "frequency_penalty": 0.0, "presence_penalty": 0.0, "json_schema": None, "regex": None,
        "ebnf": None, "stop_regex": None, "spaces_between_special_tokens": True, "n": 1, "min_new_tokens": 0},
        "image_data": None, "lora_path": None, "return_hidden_states": False, "session_id": "abc",
        "logprob_start_len": -1, "top_logprobs_num": 0, "return_text_in_logprobs": False})
    assert ok["meta_info"]["completion_tokens"] == 2
    # the ones that ask for something not implemented: 400 naming the field
    for body, param in [({"sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
                        ({"sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
                        ({"image_data": "http://x/y.png"}, "image_data"),
                        ({"return_hidden_states": True}, "return_hidden_states"),
                        ({"lora_path": "adapter"}, "lora_path"),
                        ({"no_such_field": 1}, "no_such_field")]:
        e = generate(cluster, {"text": "hi", **body}, 400)
        assert e["error"]["param"] == param, (body, e)
    # batch form: a list back, one per prompt, in order
    batch = generate(cluster, {"text": ["a b c", "d e"], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[1]["output_ids"] == generate(cluster, {"text": "d e", "sampling_params": {
        "max_new_tokens": 2, "temperature": 0}})["output_ids"]
    ids_batch = generate(cluster, {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": [
        {"max_new_tokens": 1}, {"max_new_tokens": 3}], "rid": ["r1", "r2"]})
    assert [len(x["output_ids"]) for x in ids_batch] == [1, 3] and ids_batch[1]["meta_info"]["id"] == "r2"
    with httpx.stream("POST", f"{cluster.url}/generate", json={"text": ["a", "b"], "stream": True,
                                                               "sampling_params": {"max_new_tokens": 2}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert {ev["index"] for ev in events} == {0, 1}
    # the context-length error names the field the prompt came in
    long_ids = list(range(5, 5 + 2100))
    assert generate(cluster, {"input_ids": long_ids}, 400)["error"]["param"] == "input_ids"
    assert generate(cluster, {"text": "word " * 2100}, 400)["error"]["param"] == "text"
    e = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": long_ids}).json()
    assert e["error"]["param"] == "prompt"
    e = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "x", "max_tokens": 4, "min_tokens": 9}).json()
    assert e["error"]["param"] == "min_tokens"
    # an OpenAI-side extension asking for output this server does not produce is not ignored
    e = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "x", "prompt_logprobs": 1}).json()
    assert e["error"]["param"] == "prompt_logprobs"
    assert generate(cluster, {"text": "hi", "bootstrap_room": None, "sampling_params": {"max_new_tokens": 1}})
    wait_pages_free(cluster)
