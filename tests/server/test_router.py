"""The router as a real process, against test-double instances that speak the ZMQ protocol."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from .conftest import start_cluster
from .fake_instance import fake_token

MODEL = "glm-5-tiny"


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=30)


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_models_health_metrics(cluster):
    r = httpx.get(cluster.url + "/v1/models")
    assert r.status_code == 200
    card = r.json()["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 512
    assert httpx.get(cluster.url + "/health").json() == {"status": "ok"}
    assert httpx.get(cluster.url + "/health_generate", timeout=10).status_code == 200
    info = cluster.server_info()
    assert [i["name"] for i in info["prefill"]] == ["p0"] and len(info["decode"]) == 2
    assert all(i["healthy"] for i in info["prefill"] + info["decode"])
    text = httpx.get(cluster.url + "/metrics").text
    for name in ("sglang:time_to_first_token_seconds_bucket", "sglang:inter_token_latency_seconds_bucket",
                 "sglang:e2e_request_latency_seconds_bucket", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                 "sglang:token_usage", "sglang:kv_transfer_latency_ms"):
        assert name in text, name


def test_chat_non_stream_openai_client(cluster):
    c = client(cluster)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=12,
                                  temperature=0)
    ChatCompletion.model_validate(r.model_dump())
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    # deterministic tokens from the fake decode, detokenized by the router
    tok = httpx.post(cluster.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]}).json()
    assert tok["count"] == r.usage.prompt_tokens
    expected = [fake_token(tok["tokens"], s) for s in range(12)]
    assert r.choices[0].message.content == httpx.post(cluster.url + "/detokenize",
                                                      json={"tokens": expected}).json()["prompt"]


def test_chat_stream_openai_client(cluster):
    c = client(cluster)
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=9,
                                       stream=True, stream_options={"include_usage": True}, temperature=0)
    chunks = list(stream)
    for ch in chunks:
        ChatCompletionChunk.model_validate(ch.model_dump())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    full = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=9,
                                     temperature=0)
    assert text == full.choices[0].message.content


def test_raw_sse_format(cluster):
    r = httpx.post(cluster.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = sse_events(r.text)
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ev[-3]["choices"][0]["finish_reason"] == "length" and ev[-3]["choices"][0]["delta"] == {}
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 4
    assert ev[-1] == "[DONE]"
    assert all(e["object"] == "chat.completion.chunk" for e in ev[:-1])


def test_completions(cluster):
    c = client(cluster)
    r = c.completions.create(model=MODEL, prompt="def main():", max_tokens=5)
    Completion.model_validate(r.model_dump())
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    ids = [400, 401, 402]
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    exp = httpx.post(cluster.url + "/detokenize", json={"tokens": [fake_token(ids, s) for s in range(3)]}).json()
    assert r.choices[0].text == exp["prompt"] and r.usage.prompt_tokens == 3
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=3, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 3
    r = c.completions.create(model=MODEL, prompt=[[400, 401], [500]], max_tokens=2)
    assert [ch.index for ch in r.choices] == [0, 1] and r.usage.completion_tokens == 4
    # default max_tokens for completions is 16, as in OpenAI/vLLM
    assert c.completions.create(model=MODEL, prompt="a").usage.completion_tokens == 16


def test_completions_continuous_usage_stats(cluster):
    # vLLM's stream_options.continuous_usage_stats, as chat has it: every chunk carries the
    # running usage; without it (include_usage alone) the chunks say "usage": null.
    ids = [400, 401, 402]
    body = {"prompt": ids, "max_tokens": 6, "stream": True, "echo": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    ev = sse_events(httpx.post(cluster.url + "/v1/completions", json=body, timeout=30).text)[:-1]
    usage = [e["usage"] for e in ev]
    assert all(u["prompt_tokens"] == 3 and u["total_tokens"] == 3 + u["completion_tokens"] for u in usage)
    counts = [u["completion_tokens"] for u in usage]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6 and len(set(counts)) > 2, counts
    assert ev[-1]["choices"] == [] and ev[-2]["choices"][0]["finish_reason"] == "length"
    body["stream_options"] = {"include_usage": True}
    ev = sse_events(httpx.post(cluster.url + "/v1/completions", json=body, timeout=30).text)[:-1]
    assert all(e["usage"] is None for e in ev[:-1]) and ev[-1]["usage"]["completion_tokens"] == 6


def test_return_token_ids(cluster):
    # vLLM's return_token_ids: the prompt's ids and each choice's ids beside the text, in whole
    # answers and streamed (the prompt's with a choice's first chunk, each chunk its own ids);
    # return_tokens_as_token_ids names logprob tokens "token_id:N".
    ids = [400, 401, 402]
    want = [fake_token(ids, s) for s in range(4)]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    ch = httpx.post(cluster.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert ch["prompt_token_ids"] == ids and ch["token_ids"] == want
    ev = sse_events(httpx.post(cluster.url + "/v1/completions", json={**body, "stream": True}, timeout=30).text)[:-1]
    firsts = [e["choices"][0] for e in ev if "prompt_token_ids" in e["choices"][0]]
    assert len(firsts) == 1 and firsts[0]["prompt_token_ids"] == ids
    assert [t for e in ev for t in e["choices"][0]["token_ids"]] == want
    r = httpx.post(cluster.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "logprobs": 1,
        "return_tokens_as_token_ids": True}).json()
    assert r["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in want[:2]]

    msgs = [{"role": "user", "content": "Hello"}]
    chat = {"model": MODEL, "messages": msgs, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    r = httpx.post(cluster.url + "/v1/chat/completions", json=chat, timeout=30).json()
    prompt = httpx.post(cluster.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    out = [fake_token(prompt, s) for s in range(3)]
    assert r["prompt_token_ids"] == prompt and r["choices"][0]["token_ids"] == out
    ev = sse_events(httpx.post(cluster.url + "/v1/chat/completions", json={**chat, "stream": True},
                               timeout=30).text)[:-1]
    assert ev[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in e for e in ev[1:])
    assert [t for e in ev for c in e["choices"] for t in c.get("token_ids", [])] == out
    # without the flag, none of these fields
    ch = httpx.post(cluster.url + "/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    assert "token_ids" not in ch and "prompt_token_ids" not in ch


def test_vllm_fields_that_change_the_answer_are_refused(cluster):
    # Unknown fields are ignored as vLLM ignores them, except those that would silently give
    # another answer than the one asked for; at their default values they pass.
    base = {"model": MODEL, "prompt": [400, 401], "max_tokens": 2}
    for field, value in (("guided_json", {"type": "object"}), ("allowed_token_ids", [1, 2]),
                         ("bad_words", ["x"]), ("truncate_prompt_tokens", 1), ("use_beam_search", True)):
        r = httpx.post(cluster.url + "/v1/completions", json={**base, field: value}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    r = httpx.post(cluster.url + "/v1/completions", timeout=30,
                   json={**base, "use_beam_search": False, "length_penalty": 1.0, "priority": 3})
    assert r.status_code == 200, r.text
    r = httpx.post(cluster.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


def test_continue_final_message(cluster):
    # vLLM's continue_final_message: the answer continues the client's assistant text (the prompt
    # ends at it), on /v1/chat/completions and /tokenize alike; with add_generation_prompt also
    # true it is a 400 naming the field.
    msgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "def f(x):"}]
    tok = httpx.post(cluster.url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False,
                                                     "continue_final_message": True}).json()["tokens"]
    text = httpx.post(cluster.url + "/detokenize", json={"tokens": tok}).json()["prompt"]
    assert text.endswith("<|user|>Hello<|assistant|></think>def f(x):"), text
    body = {"model": MODEL, "messages": msgs, "max_tokens": 3, "temperature": 0, "continue_final_message": True,
            "return_token_ids": True}
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == tok
    r = httpx.post(cluster.url + "/v1/chat/completions", json={**body, "add_generation_prompt": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_sglang_info_endpoints(cluster):
    info = httpx.get(cluster.url + "/get_model_info").json()
    assert info["model_path"] and info["tokenizer_path"] and info["is_generation"] is True
    assert info["model_type"] == "glm_moe_dsa" and info["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert {"preferred_sampling_params", "weight_version"} <= set(info)
    assert httpx.get(cluster.url + "/model_info").json() == info
    server = httpx.get(cluster.url + "/get_server_info").json()
    assert server["served_model_name"] == MODEL and server["context_length"] == 512 and server["tp_size"] == 1
    assert server["disaggregation_mode"] == "pd" and server["speculative_algorithm"] is None
    assert server["max_total_num_tokens"] > 0 and server["max_req_input_len"] == 511
    assert isinstance(server["internal_states"], list) and server["version"] == "0.1.0"
    assert [i["name"] for i in server["prefill"]] == ["p0"] and server["router"]["running_requests"] == 0
    assert httpx.get(cluster.url + "/version").json() == {"version": "0.1.0"}


def test_sglang_generate(cluster):
    r = httpx.post(cluster.url + "/generate", json={"input_ids": [400, 401, 402],
                                                    "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    body = r.json()
    assert r.status_code == 200, body
    assert body["output_ids"] == [fake_token([400, 401, 402], s) for s in range(4)]
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert body["meta_info"]["prompt_tokens"] == 3 and body["meta_info"]["completion_tokens"] == 4
    r = httpx.post(cluster.url + "/generate", json={"text": "hello", "stream": True,
                                                    "sampling_params": {"max_new_tokens": 3}})
    ev = sse_events(r.text)
    assert ev[-2]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(ev[-2]["output_ids"]) == 3 and ev[-2]["text"].startswith(ev[0]["text"])


def test_stop_strings_and_stop_token_ids(cluster):
    ids = [400, 401, 402]
    toks = [fake_token(ids, s) for s in range(8)]
    d = lambda t: httpx.post(cluster.url + "/detokenize", json={"tokens": t}).json()["prompt"]  # noqa: E731
    full = d(toks)
    stop = d(toks[3:5]).strip() or d(toks[3:5])
    idx = full.find(stop)
    r = httpx.post(cluster.url + "/v1/completions", json={"prompt": ids, "max_tokens": 8, "stop": [stop]}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["matched_stop"] == stop
    assert r["choices"][0]["text"] == full[:idx]
    r = httpx.post(cluster.url + "/v1/completions", json={"prompt": ids, "max_tokens": 8,
                                                          "stop_token_ids": [toks[2]]}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["matched_stop"] == toks[2]
    assert r["choices"][0]["text"] == d(toks[:2]) and r["usage"]["completion_tokens"] == 3
    # streamed: the stop string never reaches the client
    r = httpx.post(cluster.url + "/v1/completions", json={"prompt": ids, "max_tokens": 8, "stop": stop,
                                                          "stream": True})
    ev = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == full[:idx]
    # vLLM's include_stop_str_in_output (SGLang's no_stop_trim): the matched string stays
    r = httpx.post(cluster.url + "/v1/completions", json={"prompt": ids, "max_tokens": 8, "stop": [stop],
                                                          "include_stop_str_in_output": True}).json()
    assert r["choices"][0]["text"] == full[:idx] + stop and r["choices"][0]["finish_reason"] == "stop"


def err(r, status):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["message"]
    # vLLM's error type names (router/schemas.py ERROR_TYPES), not HTTP reason phrases
    assert body["error"]["type"] == {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                                     503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}[status], body
    return body["error"]


def test_error_bodies(cluster):
    u = cluster.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "x"}]
    e = err(httpx.post(u, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "JSON" in e["message"]
    err(httpx.post(u, json={"messages": "hello"}), 400)
    err(httpx.post(u, json={"messages": msgs, "max_tokens": "ten"}), 400)
    e = err(httpx.post(u, json={"messages": msgs, "max_tokens": -1}), 400)
    assert "max_tokens" in e["param"]
    err(httpx.post(u, json={"messages": []}), 400)
    err(httpx.post(u, json=[1, 2]), 400)
    err(httpx.post(u, json={"messages": msgs, "temperature": -1}), 400)
    err(httpx.post(u, json={"messages": msgs, "top_k": 0}), 400)
    err(httpx.post(u, json={"messages": msgs, "n": 65}), 400)
    err(httpx.post(u, json={"messages": msgs, "bootstrap_room": 5}), 400)
    e = err(httpx.post(u, json={"messages": [{"role": "user", "content": "word " * 600}]}), 400)
    assert "maximum context length is 512" in e["message"]
    e = err(httpx.post(u, json={"messages": msgs, "max_tokens": 600}), 400)
    assert "maximum context length" in e["message"]
    e = err(httpx.post(u, json={"model": "gpt-4", "messages": msgs}), 404)
    assert e["param"] == "model" and "gpt-4" in e["message"]
    err(httpx.post(cluster.url + "/v1/completions", json={"prompt": [999999]}), 400)
    err(httpx.post(cluster.url + "/v1/completions", json={"prompt": ""}), 400)
    err(httpx.get(cluster.url + "/v1/nope"), 404)
    err(httpx.get(cluster.url + "/v1/models/nope"), 404)
    err(httpx.delete(cluster.url + "/v1/models"), 405)
    # the openai client maps them to its exception classes
    c = client(cluster)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=-5)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=msgs)
    # a zero-token request finishes without touching the instances
    r = httpx.post(cluster.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["choices"][0]["text"] == ""


def test_concurrent_streams(cluster):
    async def one(i: int, http: httpx.AsyncClient) -> str:
        async with http.stream("POST", cluster.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 20,
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            return "".join([x async for x in r.aiter_text()])

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(one(i, http) for i in range(32)))

    outs = asyncio.run(run())
    for text in outs:
        ev = sse_events(text)
        assert ev[-2]["usage"]["completion_tokens"] == 20
    info = cluster.server_info()
    assert all(i["in_flight"] == 0 for i in info["prefill"] + info["decode"])
    assert info["router"]["running_requests"] == 0


def test_client_disconnect_aborts(cluster):
    with httpx.stream("POST", cluster.url + "/v1/completions", json={
            "prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}, timeout=30) as r:
        it = r.iter_lines()
        next(it)
        info = cluster.server_info()
        assert info["router"]["running_requests"] == 1
    for _ in range(50):
        info = cluster.server_info()
        if info["router"]["running_requests"] == 0:
            break
        time.sleep(0.1)
    assert info["router"]["running_requests"] == 0
    assert all(i["in_flight"] == 0 for i in info["decode"])
    assert "sglang:num_aborted_requests_total" in httpx.get(cluster.url + "/metrics").text


def test_decode_dies_mid_stream(tmp_path, model_dir, glm53_cache):
    # A long restart backoff: the killed instances stay down for this test (test_supervisor.py
    # covers their restart).
    c = start_cluster(tmp_path, model_dir, glm53_cache, n_prefill=1, n_decode=2,
                      router={"restart_backoff_s": 60}, env={"FAKE_TOKEN_DELAY": "0.05"})
    try:
        t0 = time.monotonic()
        with httpx.stream("POST", c.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 400,
                "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            got = []
            for line in lines:
                if line:
                    got.append(line)
                if len(got) == 3:
                    victim = next(i["name"] for i in c.server_info()["decode"] if i["in_flight"] == 1)
                    os.kill(c.pid(victim), signal.SIGKILL)
                    break
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])
        assert "error" in error and victim in error["error"]["message"]
        assert time.monotonic() - t0 < 10  # health_timeout_s is 1.5 s
        # the router stays healthy and routes around the dead instance
        assert httpx.get(c.url + "/health").status_code == 200
        for _ in range(3):
            r = httpx.post(c.url + "/v1/completions", json={"prompt": "y", "max_tokens": 3}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # the openai client raises on the in-stream error event
        os.kill(c.pid(next(n for n in ("d0", "d1") if n != victim)), signal.SIGKILL)
        time.sleep(2.0)
        r = httpx.post(c.url + "/v1/completions", json={"prompt": "y", "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert httpx.get(c.url + "/health").status_code == 503
        assert httpx.get(c.url + "/v1/models").status_code == 200
    finally:
        assert c.stop() == 0


def test_prefill_failure_is_an_error_event(tmp_path, model_dir, glm53_cache):
    c = start_cluster(tmp_path, model_dir, glm53_cache, env={"FAKE_PREFILL_FAIL": "bootstrap to d0 timed out",
                                                             "FAKE_TOKEN_DELAY": "0.5"})
    try:
        r = httpx.post(c.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                             "max_tokens": 5, "stream": True}, timeout=30)
        ev = sse_events(r.text)
        assert ev[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "bootstrap to d0 timed out" in ev[-2]["error"]["message"]
        r = httpx.post(c.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=30)
        assert r.status_code >= 500 and "p0" in r.json()["error"]["message"]
        assert httpx.get(c.url + "/health").status_code == 200
    finally:
        c.stop()
    # With one prefill instance there is nothing to retry on, and the log says so.
    log = c.log_path.read_text()
    assert "no other prefill instance to retry on" in log and "retrying on another" not in log


def test_failed_prefill_is_retried_on_another(tmp_path, model_dir, glm53_cache):
    c = start_cluster(tmp_path, model_dir, glm53_cache, n_prefill=2, n_decode=1, router={"policy": "round_robin"},
                      env={"FAKE_PREFILL_FAIL": "p0 is broken", "FAKE_PREFILL_FAIL_ONLY": "p0",
                           "FAKE_FIRST_TOKEN_DELAY": "0.3"})
    try:
        for _ in range(4):
            r = httpx.post(c.url + "/v1/completions", json={"prompt": [400, 401], "max_tokens": 3}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        assert all(i["in_flight"] == 0 for i in c.server_info()["prefill"] + c.server_info()["decode"])
    finally:
        c.stop()
    assert c.log_path.read_text().count("retrying on another prefill instance") >= 2


def test_eos_and_up_shutdown_leaves_no_processes(tmp_path, model_dir, glm53_cache):
    c = start_cluster(tmp_path, model_dir, glm53_cache, env={"FAKE_EOS_AT": "3", "FAKE_TRANSFER_BYTES": "4096"})
    try:
        r = httpx.post(c.url + "/v1/completions", json={"prompt": [400], "max_tokens": 10}).json()
        assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 4
        assert r["choices"][0]["matched_stop"] == 4096  # <|endoftext|>, not shown in the text
        r = httpx.post(c.url + "/v1/completions", json={"prompt": [400], "max_tokens": 10, "ignore_eos": True}).json()
        assert r["choices"][0]["finish_reason"] == "length"
        assert "glm53:kv_transfer_bytes_total" in httpx.get(c.url + "/metrics").text
        pids = [c.pid(n) for n in ("p0", "d0")]
    finally:
        assert c.stop() == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
