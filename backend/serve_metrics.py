"""Prometheus metrics for `pagesim serve`, under vLLM's names where vLLM has one (so dashboards and
benchmark tools that scrape a vLLM server read this one too), on a registry of its own.

Gauges are set by the engine thread after every step; counters and histograms as requests get
tokens and end. prometheus_client's metrics are thread-safe, so /metrics reads them from the event
loop while the engine writes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from backend.async_engine import EngineObserver
from policies.request import SequenceGroup
from policies.scheduler import Scheduler

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ServeMetrics(EngineObserver):
    """The engine's observer that keeps the exported metrics; `exposition()` is the /metrics body."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, lab, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, lab, registry=r).labels(model_name)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.swapped = gauge("vllm:num_requests_swapped", "Requests swapped out to CPU memory")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache memory allocated (1 = full)")
        self.gpu_usage = gauge("vllm:gpu_cache_usage_perc", "The same as vllm:kv_cache_usage_perc (vLLM V0 name)")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (recompute or swap)")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests that got a first token")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between a request's successive tokens",
                        ITL_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Per request: (e2e - ttft) / (output - 1)",
                         ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to last token", E2E_BUCKETS)
        self._success = Counter("vllm:request_success", "Requests finished, by reason", ["model_name",
                                "finished_reason"], registry=r)
        self._model = model_name
        self.aborted = counter("pagesim:requests_aborted", "Requests aborted (client gone, shutdown)")
        self.rejected = counter("pagesim:requests_rejected", "Requests the scheduler rejected")
        self.refused = counter("pagesim:requests_refused", "Calls answered 400/413/429/503 before the engine")
        # calls that never became requests for the engine, apart from the refused ones (so that the
        # calls a server saw add up: engine requests' calls + refused + timed out + abandoned)
        self._timed_out = Counter("pagesim:requests_timed_out", "Calls whose head or body did not arrive in "
                                  "time (408)", ["model_name", "phase"], registry=r)
        self.abandoned = counter("pagesim:uploads_abandoned", "Calls whose client left while sending the body")

    def timed_out(self, phase: str) -> None:
        """A call's head ("header") or body ("body") did not arrive within its read timeout."""
        self._timed_out.labels(self._model, phase).inc()

    def on_step(self, scheduler: Scheduler, duration: float, num_preempted: int) -> None:
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.swapped.set(len(scheduler.swapped))
        mem = scheduler.memory()
        total = mem.token_states + mem.reserved + mem.internal_frag + mem.external_frag + mem.free
        usage = 1.0 - mem.free / total if total else 0.0
        self.kv_usage.set(usage)
        self.gpu_usage.set(usage)
        if num_preempted:
            self.preemptions.inc(num_preempted)

    def on_first_token(self, group: SequenceGroup, ttft: float) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(group.request.prompt_len)
        self.prefix_queries.inc(group.request.prompt_len)
        self.prefix_hits.inc(group.prefix_hit_tokens)

    def on_token_gap(self, group: SequenceGroup, gap: float) -> None:
        self.itl.observe(gap)

    def on_end(self, group: SequenceGroup, status: str) -> None:
        out = sum(s.output_len for s in group.seqs + group.finished_seqs)
        self.generation_tokens.inc(out)
        if status == "abort":
            self.aborted.inc()
            return
        if status == "rejected":
            self.rejected.inc()
            return
        self._success.labels(self._model, status).inc()
        if group.finish_time is not None:
            self.e2e.observe(group.finish_time - group.arrival)
            if group.first_token_time is not None and group.output_len > 1:
                self.tpot.observe((group.finish_time - group.first_token_time) / (group.output_len - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
