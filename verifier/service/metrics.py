"""Prometheus metrics named like vLLM's (``stree:`` instead of ``vllm:``), on each server's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    """Counters, gauges and histograms of one served model (label ``model_name``)."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, registry=r, buckets=buckets).labels(model_name)

        self.accepted = counter("stree:spec_decode_num_accepted_tokens", "Drafted tokens the verifier accepted")
        self.drafted = counter("stree:spec_decode_num_draft_tokens", "Drafted tokens verified")
        self.drafts = counter("stree:spec_decode_num_drafts", "Verifier steps that checked a drafted tree")
        self._per_pos = Counter("stree:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted drafted tokens by their depth in the tree", labels + ["position"],
                                registry=r)
        self.generation_tokens = counter("stree:generation_tokens", "Generated tokens")
        self.prompt_tokens = counter("stree:prompt_tokens", "Prompt tokens prefilled")
        self.fallbacks = counter("stree:drafter_fallbacks", "Steps run root-only because the drafter failed or was late")
        self._success = Counter("stree:request_success", "Finished requests", labels + ["finished_reason"], registry=r)
        self.rejected = counter("stree:request_rejected", "Requests refused because the queue was full")
        self.running = Gauge("stree:num_requests_running", "Requests in engine slots", labels,
                             registry=r).labels(model_name)
        self.waiting = Gauge("stree:num_requests_waiting", "Requests waiting for a slot", labels,
                             registry=r).labels(model_name)
        self.ttft = histogram("stree:time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = histogram("stree:inter_token_latency_seconds", "Time between streamed token chunks, per token",
                             TOKEN_BUCKETS)
        self.tpot = histogram("stree:time_per_output_token_seconds",
                              "Decode time divided by the tokens after the first", TOKEN_BUCKETS)
        self.e2e = histogram("stree:e2e_request_latency_seconds", "Request latency", E2E_BUCKETS)
        self.queue_time = histogram("stree:request_queue_time_seconds", "Time from arrival to the first step",
                                    E2E_BUCKETS)
        self.accept_len = histogram("stree:spec_decode_accepted_length", "Tokens emitted per verifier step",
                                    tuple(range(1, 17)) + (24, 32, 64))

    def success(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def accepted_at(self, per_pos: list[int]) -> None:
        for pos, n in enumerate(per_pos):
            if n:
                self._per_pos.labels(self.model_name, str(pos)).inc(n)
