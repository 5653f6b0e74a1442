"""What one client may send, against the router as a real process (test-double instances): input
that is not valid text is a 400 naming the field, bodies over the limit a 413 before parsing,
prompts that certainly cannot fit a 400 without tokenizing them, a batch that can never be
admitted a 400, and heavy requests never stall /health or keep the router's memory."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import httpx
import pytest

from .conftest import start_cluster

MAX_BYTES = 6 << 20
CAPACITY = 8


@pytest.fixture(scope="module")
def limits_cluster(tmp_path_factory, model_dir, glm53_cache):
    c = start_cluster(tmp_path_factory.mktemp("limits"), model_dir, glm53_cache,
                      router={"max_request_bytes": MAX_BYTES, "max_running_requests": CAPACITY})
    yield c
    c.stop()


def post(c, path: str, raw: bytes, timeout: float = 60) -> httpx.Response:
    return httpx.post(c.url + path, content=raw, headers={"content-type": "application/json"}, timeout=timeout)


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    # vLLM's error type names (router/schemas.py ERROR_TYPES), not HTTP reason phrases
    assert body["error"]["type"] == {400: "BadRequestError", 413: "RequestEntityTooLargeError"}[status], body
    return body["error"]


# JSON escapes as a client writes them: json.dumps cannot produce lone surrogates from bytes.
SURROGATE_CASES = [
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi \\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"model":"\\udfff","messages":[{"role":"user","content":"hi"}]}', "model"),
    ("/v1/completions", b'{"prompt":"x \\uDBFF"}', "prompt"),
    ("/v1/completions", b'{"prompt":["fine","bad \\ud800"]}', "prompt[1]"),
    ("/v1/completions", b'{"prompt":"x","stop":["\\ud800"]}', "stop[0]"),
    ("/generate", b'{"text":"\\ud800"}', "text"),
    ("/tokenize", b'{"prompt":"\\ud800"}', "prompt"),
    ("/v1/tokenize", b'{"messages":[{"role":"user","content":"\\udc00"}]}', "messages[0].content"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATE_CASES)
def test_lone_surrogate_is_a_400_naming_the_field(limits_cluster, path, raw, param):
    e = error(post(limits_cluster, path, raw), 400)
    assert e["param"] == param and "surrogate" in e["message"]


def test_valid_text_and_encodings(limits_cluster):
    c = limits_cluster
    # A surrogate pair is a valid character.
    r = post(c, "/v1/chat/completions", b'{"messages":[{"role":"user","content":"\\ud83c\\udf0d"}],"max_tokens":2}')
    assert r.status_code == 200, r.text
    e = error(post(c, "/v1/completions", b'{"prompt":"x\xff"}'), 400)
    assert "UTF-8" in e["message"] and e["param"] == "body"
    e = error(post(c, "/v1/completions", b"[" * 100_000 + b"]" * 100_000), 400)
    assert "nested too deeply" in e["message"]


def test_body_is_json_whatever_its_content_type(limits_cluster):
    # `curl -d` sends application/x-www-form-urlencoded; no Content-Type at all is read as JSON too.
    body = b'{"prompt": [400, 401], "max_tokens": 2}'
    for ctype in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"content-type": ctype} if ctype else {}
        r = httpx.post(limits_cluster.url + "/v1/completions", content=body, headers=headers, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, (ctype, r.text)
    r = httpx.post(limits_cluster.url + "/generate", content=b"prompt=hello",
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=30)
    e = error(r, 400)
    assert e["message"] == "The request body is not valid JSON." and e["param"] == "body"


def test_body_over_the_limit_is_413_before_parsing(limits_cluster):
    c = limits_cluster
    big = b'{"prompt":"' + b"a" * MAX_BYTES + b'"}'
    e = error(post(c, "/v1/completions", big), 413)
    assert str(MAX_BYTES) in e["message"] and "max_request_bytes" in e["message"]

    def chunks():  # no Content-Length: refused once the bytes read pass the limit
        for _ in range(MAX_BYTES // 100_000 + 2):
            yield b"x" * 100_000

    e = error(httpx.post(c.url + "/v1/chat/completions", content=chunks(),
                         headers={"content-type": "application/json"}, timeout=60), 413)
    assert "more than" in e["message"]
    assert httpx.get(c.url + "/health").status_code == 200


def test_certainly_too_long_prompt_is_refused_without_tokenizing(limits_cluster):
    c = limits_cluster
    # 5 MB of text: over 512 tokens x 64 bytes per token whatever the tokenizer does.
    body = json.dumps({"messages": [{"role": "user", "content": "word " * 1_000_000}]}).encode()
    t0 = time.monotonic()
    e = error(post(c, "/v1/chat/completions", body), 400)
    assert "at least" in e["message"] and "maximum context length is 512" in e["message"]
    assert time.monotonic() - t0 < 5
    e = error(post(c, "/v1/completions", json.dumps({"prompt": [5] * 1_000_000}).encode()), 400)
    assert "1000000 input tokens" in e["message"] and e["param"] == "prompt"
    # Just under the context is tokenized and served.
    ok = post(c, "/v1/completions", json.dumps({"prompt": "a" * 100, "max_tokens": 2}).encode())
    assert ok.status_code == 200, ok.text


def test_too_many_stops_is_a_400(limits_cluster):
    e = error(post(limits_cluster, "/v1/completions", json.dumps({"prompt": "x", "stop": ["a"] * 65}).encode()), 400)
    assert e["param"] == "stop" and "at most 64" in e["message"]
    e = error(post(limits_cluster, "/generate", json.dumps({"text": "x", "sampling_params": {
        "stop": [str(i) for i in range(1000)]}}).encode()), 400)
    assert e["param"] == "stop"
    body = json.dumps({"prompt": "x", "stop_token_ids": [5] * 2000}).encode()
    e = error(post(limits_cluster, "/v1/completions", body), 400)
    assert e["param"] == "stop_token_ids" and "at most 1024" in e["message"]


def test_more_prompts_than_capacity_is_a_400(limits_cluster):
    c = limits_cluster
    e = error(post(c, "/v1/completions", json.dumps({"prompt": ["a"] * (CAPACITY + 1)}).encode()), 400)
    assert e["param"] == "prompt" and f"at most {CAPACITY}" in e["message"]
    e = error(post(c, "/v1/completions", json.dumps({"prompt": [[400]] * 2000}).encode()), 400)
    assert "2000 generations" in e["message"]
    r = post(c, "/v1/completions", json.dumps({"prompt": ["a"] * CAPACITY, "max_tokens": 2}).encode())
    assert r.status_code == 200 and len(r.json()["choices"]) == CAPACITY


def router_rss_mb(c) -> float:
    pid = subprocess.run(["pgrep", "-P", str(c.proc.pid), "-f", "glm53.server.cli router"],
                         capture_output=True, text=True).stdout.split()[0]
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_heavy_requests_do_not_stall_health_or_keep_memory(limits_cluster):
    c = limits_cluster
    post(c, "/tokenize", json.dumps({"prompt": "warm up " * 1000}).encode())
    time.sleep(1.0)
    base = router_rss_mb(c)
    text = "".join(f"def f{i}(x):\n    return x * {i}  # Grüße 世界\n" for i in range(100_000))[:4_000_000]
    latencies: list[float] = []
    stop = threading.Event()

    def poll_health():
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                t0 = time.monotonic()
                assert http.get(c.url + "/health").status_code == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.02)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    try:
        t0 = time.monotonic()
        r = post(c, "/tokenize", json.dumps({"prompt": text}).encode())  # tokenized whole (no context limit)
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["count"] > 500_000
        error(post(c, "/v1/chat/completions",
                   json.dumps({"messages": [{"role": "user", "content": text}]}).encode()), 400)
        error(post(c, "/v1/completions", json.dumps({"prompt": [7] * 2_000_000}).encode()), 400)
    finally:
        stop.set()
        poller.join(10)
    print(f"\nLIMITS took={took:.2f}s health_max={max(latencies):.3f}s n={len(latencies)} base={base:.0f}MB")
    assert len(latencies) > 10
    # The tokenization above took seconds; /health never waited for it.
    assert max(latencies) < max(0.75, took / 3), (max(latencies), took)
    time.sleep(1.0)  # the heap trim runs after the handler returns
    print(f"LIMITS rss_after={router_rss_mb(c):.0f}MB")
    assert router_rss_mb(c) < base + 64, (base, router_rss_mb(c))
