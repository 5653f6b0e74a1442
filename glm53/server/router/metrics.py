"""Prometheus metrics of the router, with SGLang-compatible names.

Router-side latencies are the truthful ones in PD (TTFT includes queueing, prefill and the KV
transfer). Instance gauges (running/waiting requests, KV usage) come from the instances' health
replies, labelled with engine_type (prefill/decode) and the instance name. Each router owns its
own registry: no process-global state, so tests can run several routers in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from glm53.server.protocol import LoadStats, TransferStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000, 120000)
_MB_BUCKETS = (0.01, 0.1, 0.5, 1, 5, 10, 50, 100, 500, 1000, 5000)


class RouterMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        m = ["model_name"]
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token (router-side).", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Latency between output tokens.", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("sglang:request_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency.", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens processed.", m, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Generated tokens.", m, registry=r)
        # Prompt tokens whose KV a prefill instance's prefix cache held (cached / prompt = hit rate).
        self.cached_tokens = Counter("sglang:cached_tokens", "Prompt tokens reused from the prefix cache.", m,
                                     registry=r)
        self.requests = Counter("sglang:num_requests", "Requests finished, by finish reason.",
                                [*m, "finished_reason"], registry=r)
        self.aborted = Counter("sglang:num_aborted_requests", "Requests aborted (client disconnect, failure, shutdown).",
                               m, registry=r)
        # Speculative decoding: tokens each verify step committed (accepted drafts + 1); the
        # mean is SGLang's sglang:spec_accept_length.
        self.spec_accept = Histogram("sglang:spec_accept_length", "Tokens committed per speculative verify step.",
                                     m, buckets=tuple(range(1, 17)) + (24, 32), registry=r)
        self.router_running = Gauge("glm53:router_running_requests", "Requests in flight at the router.", m,
                                    registry=r)
        inst = [*m, "engine_type", "instance"]
        self.running = Gauge("sglang:num_running_reqs", "Requests in an instance's running batch.", inst, registry=r)
        self.waiting = Gauge("sglang:num_queue_reqs", "Requests queued at an instance.", inst, registry=r)
        self.transferring = Gauge("sglang:num_decode_transfer_queue_reqs", "Requests whose KV is in flight.",
                                  inst, registry=r)
        self.token_usage = Gauge("sglang:token_usage", "Fraction of KV pages in use.", inst, registry=r)
        self.used_tokens = Gauge("sglang:num_used_tokens", "KV tokens in use.", inst, registry=r)
        self.max_tokens = Gauge("sglang:max_total_num_tokens", "KV capacity in tokens.", inst, registry=r)
        self.gen_throughput = Gauge("sglang:gen_throughput", "Generation throughput (tokens/s).", inst, registry=r)
        self.healthy = Gauge("glm53:instance_healthy", "1 when the instance answers health checks.", inst,
                             registry=r)
        self.transfer_latency = Histogram("sglang:kv_transfer_latency_ms", "KV transfer time per request (ms).", m,
                                          buckets=_MS_BUCKETS, registry=r)
        self.transfer_bootstrap = Histogram("sglang:kv_transfer_bootstrap_ms", "Transfer bootstrap time (ms).", m,
                                            buckets=_MS_BUCKETS, registry=r)
        self.transfer_mb = Histogram("sglang:kv_transfer_total_mb", "KV bytes moved per request (MB).", m,
                                     buckets=_MB_BUCKETS, registry=r)
        self.transfer_bytes = Counter("glm53:kv_transfer_bytes", "KV bytes moved.", m, registry=r)
        self.transfer_failed = Counter("sglang:num_transfer_failed_reqs", "Requests failed in bootstrap/transfer.",
                                       m, registry=r)
        # The admission queue (router/admission.py): its depth is sglang:num_queue_reqs with
        # engine_type "router"; the wait from arrival until both instances admitted the request
        # (router queue + instance queues) is SGLang's queue-time histogram.
        self.queue_time = Histogram("sglang:queue_time_seconds", "Time from arrival until both instances "
                                    "admitted the request (router and instance queues).", m,
                                    buckets=_LATENCY_BUCKETS + (600.0, 1200.0), registry=r)
        self.queue_rejected = Counter("glm53:queue_rejected_requests", "Requests refused by the admission queue "
                                      "(503 with Retry-After), by reason: full, timeout, overloaded.",
                                      [*m, "reason"], registry=r)
        self.restarts = Counter("glm53:instance_restarts", "Instance restarts the router saw (a new incarnation).",
                                inst, registry=r)
        # cache_aware routing: prefill picks made for a cached prefix ("cache") or by load ("load").
        self.cache_routed = Counter("glm53:cache_aware_routed", "Prefill picks by the cache_aware policy.",
                                    [*m, "by"], registry=r)

        # Create the model-labelled series now, so /metrics lists them before the first request.
        for metric in (self.ttft, self.itl, self.tpot, self.e2e, self.prompt_tokens, self.generation_tokens,
                       self.cached_tokens, self.aborted, self.router_running, self.transfer_latency, self.transfer_bootstrap,
                       self.transfer_mb, self.transfer_bytes, self.transfer_failed, self.queue_time):
            metric.labels(model_name)
        self.set_router_queue(0)

    def observe_load(self, role: str, name: str, load: LoadStats, healthy: bool) -> None:
        lab = (self.model_name, role, name)
        self.running.labels(*lab).set(load.num_running)
        self.waiting.labels(*lab).set(load.num_waiting)
        self.transferring.labels(*lab).set(load.num_transferring)
        total = load.kv_pages_total
        self.token_usage.labels(*lab).set(load.kv_pages_used / total if total else 0.0)
        self.used_tokens.labels(*lab).set(load.kv_pages_used * load.page_size)
        self.max_tokens.labels(*lab).set(total * load.page_size)
        self.gen_throughput.labels(*lab).set(load.gen_throughput)
        self.healthy.labels(*lab).set(1 if healthy else 0)

    def routed_by_cache(self, hit: bool) -> None:
        self.cache_routed.labels(self.model_name, "cache" if hit else "load").inc()

    def set_router_queue(self, depth: int) -> None:
        """The admission queue's depth (requests waiting at the router for an instance pair)."""
        self.waiting.labels(self.model_name, "router", "router").set(depth)

    def set_health(self, role: str, name: str, healthy: bool) -> None:
        self.healthy.labels(self.model_name, role, name).set(1 if healthy else 0)

    def observe_transfer(self, t: TransferStats) -> None:
        m = self.model_name
        if t.seconds:
            self.transfer_latency.labels(m).observe(t.seconds * 1000)
        if t.bootstrap_seconds:
            self.transfer_bootstrap.labels(m).observe(t.bootstrap_seconds * 1000)
        if t.bytes:
            self.transfer_mb.labels(m).observe(t.bytes / 1e6)
            self.transfer_bytes.labels(m).inc(t.bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
