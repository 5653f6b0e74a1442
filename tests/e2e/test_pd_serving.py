"""End to end through real processes: router (HTTP) -> prefill -> NIXL/UCX KV transfer ->
decode, on the embedded tiny model, checked with the `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from glm53.server.embedded_model import EMBEDDED_DIRNAME
from tests.e2e import structured_checks
from tests.e2e.served import GREEDY_PROMPTS, MODEL, offline_greedy, served_greedy, wait_pages_free


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", timeout=120)


def test_chat_and_completions_stream_and_non_stream(cluster):
    c = client(cluster)
    msgs = [{"role": "user", "content": "Write a Python function."}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage.completion_tokens == 12 or chat.choices[0].finish_reason == "stop"
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content  # greedy: stream and non-stream agree
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [chat.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    comp = c.completions.create(model=MODEL, prompt="import os\nimport sys\n", max_tokens=10, temperature=0)
    assert comp.object == "text_completion" and comp.usage.completion_tokens <= 10
    streamed = "".join(x.choices[0].text for x in c.completions.create(
        model=MODEL, prompt="import os\nimport sys\n", max_tokens=10, temperature=0, stream=True) if x.choices)
    assert streamed == comp.choices[0].text
    # Token-id prompts.
    ids = c.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4
    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]
    wait_pages_free(cluster)


def test_greedy_matches_offline_generate(cluster, model_cache):
    """Token for token: the PD pipeline (chunked prefill of 64-token chunks, KV over UCX, decode)
    against the model core's one-process `glm53-serve generate`."""
    new = 24
    want = offline_greedy(model_cache / EMBEDDED_DIRNAME, GREEDY_PROMPTS, new)
    assert served_greedy(cluster, GREEDY_PROMPTS, new) == want
    # Again, over prefill's prefix cache: each prompt's full pages are cached now (all but the
    # last token are; 16-token pages), so only the tail is computed, and the output is the same.
    for p, out in zip(GREEDY_PROMPTS, want):
        r = httpx.post(f"{cluster.url}/generate", timeout=120, json={
            "input_ids": p, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == out
        assert r.json()["meta_info"]["cached_tokens"] == (len(p) - 1) // 16 * 16
    # A cache salt (vLLM's cache_salt; SGLang's cache_salt / extra_key) sees only its own entries.
    p = GREEDY_PROMPTS[-1]
    for salted in ({"cache_salt": "tenant-a"}, {"extra_key": "tenant-b"}):
        got = []
        for _ in range(2):
            r = httpx.post(f"{cluster.url}/generate", timeout=120, json={
                "input_ids": p, **salted, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
            assert r.status_code == 200, r.text
            got.append(r.json()["meta_info"]["cached_tokens"])
        assert got == [0, (len(p) - 1) // 16 * 16], salted
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": p, "max_tokens": 2, "temperature": 0, "cache_salt": "tenant-a"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(p) - 1) // 16 * 16
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    cached = sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines() if ln.startswith("sglang:cached_tokens_total"))
    assert cached >= sum((len(p) - 1) // 16 * 16 for p in GREEDY_PROMPTS)


def test_32_concurrent_streaming_clients(cluster):
    async def one(ac: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await ac.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=8 + i % 5,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True})
        reason, usage = None, 0
        async for ch in stream:
            if ch.choices and ch.choices[0].finish_reason:
                reason = ch.choices[0].finish_reason
            if ch.usage:
                usage = ch.usage.completion_tokens
        return reason, usage

    async def main():
        ac = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none", timeout=300)
        return await asyncio.gather(*(one(ac, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    assert all(r in ("length", "stop") and n >= 1 for r, n in results), results
    wait_pages_free(cluster)


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": [1] * 3000, "max_tokens": 1}, 400, "prompt"),
        ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_error_bodies(cluster, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param


def test_generate_refuses_sampling_params_it_does_not_implement(cluster):
    r = httpx.post(f"{cluster.url}/generate", timeout=30, json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "stop_regex": "a+"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.stop_regex"
    r = httpx.post(f"{cluster.url}/generate", timeout=30, json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "no_such_param": 1}})
    assert r.status_code == 400 and "no_such_param" in r.json()["error"]["param"]


def test_metrics_report_latency_and_transfers(cluster):
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "metrics", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text

    def value(prefix: str) -> float:
        lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
        assert lines, f"{prefix} missing from /metrics"
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)

    for name in ("sglang:time_to_first_token_seconds_count", "sglang:e2e_request_latency_seconds_count",
                 "sglang:kv_transfer_latency_ms_count", "sglang:kv_transfer_bootstrap_ms_count",
                 "glm53:kv_transfer_bytes_total"):
        assert value(name) > 0, name


def test_structured_output(cluster):
    structured_checks.check_chat_json_schema_and_json_object(cluster, structured_checks.SAMPLING[::2])
    structured_checks.check_generate_regex_ebnf_schema_and_completions(cluster)
    structured_checks.check_bad_grammars_are_400_naming_the_field(cluster)
    structured_checks.check_forced_tool_calls(cluster)
