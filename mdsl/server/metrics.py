"""The server's Prometheus metrics (GET /metrics, text format 0.0.4), through prometheus_client with a
registry of the server's own. The engine's state is read at each scrape (`LLM.stats`); the request
counters and latency histograms are kept by the server, timed when the event loop receives the tokens.

| metric | kind | what |
|---|---|---|
| mdsl_requests_running | gauge | requests the device ran in its last step |
| mdsl_requests_waiting | gauge | requests submitted and not yet admitted by the device |
| mdsl_kv_pages_in_use, mdsl_kv_pages_total | gauge | KV-cache pages held by requests / in the pool |
| mdsl_preemptions_total, mdsl_engine_steps_total | counter | the device's preemptions and steps |
| mdsl_prompt_tokens_total, mdsl_generation_tokens_total | counter | prompt tokens submitted, tokens generated |
| mdsl_generation_tokens_per_second | gauge | tokens generated over the last 10 s, per second |
| mdsl_requests_finished_total{reason} | counter | stop, length, cancelled (the client left, or shutdown), error |
| mdsl_requests_rejected_total{status} | counter | requests refused with a 4xx or 5xx before they ran |
| mdsl_time_to_first_token_seconds | histogram | submission to the first token |
| mdsl_time_per_output_token_seconds | histogram | per request: (last token - first token) / (tokens - 1) |
| mdsl_e2e_request_latency_seconds | histogram | submission to the end |
"""
from __future__ import annotations

import time
from collections import deque
from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mdsl.serving import LLM

RATE_WINDOW_S = 10.0
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineState:
    """A collector that reads the engine's stats at each scrape."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def collect(self):
        s = self.llm.stats()
        yield GaugeMetricFamily("mdsl_requests_running", "Requests the device ran in its last step.", value=s.running)
        yield GaugeMetricFamily("mdsl_requests_waiting", "Requests submitted and not yet admitted by the device.",
                                value=s.host_pending + s.queued)
        yield GaugeMetricFamily("mdsl_kv_pages_in_use", "KV-cache pages held by requests.",
                                value=s.num_pages - s.free_pages)
        yield GaugeMetricFamily("mdsl_kv_pages_total", "KV-cache pages in the pool.", value=s.num_pages)
        yield CounterMetricFamily("mdsl_preemptions", "Requests the device preempted.", value=s.preemptions)
        yield CounterMetricFamily("mdsl_engine_steps", "Steps the device ran.", value=s.steps)


class Metrics:
    def __init__(self, llm: LLM):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(llm))
        r = self.registry
        self.prompt_tokens = Counter("mdsl_prompt_tokens", "Prompt tokens submitted.", registry=r)
        self.generation_tokens = Counter("mdsl_generation_tokens", "Tokens generated.", registry=r)
        Gauge("mdsl_generation_tokens_per_second", f"Tokens generated over the last {RATE_WINDOW_S:g} s, per second.",
              registry=r).set_function(self._rate)
        self.finished = Counter("mdsl_requests_finished", "Requests finished, by reason.", ["reason"], registry=r)
        self.rejected = Counter("mdsl_requests_rejected", "Requests refused before they ran, by HTTP status.",
                                ["status"], registry=r)
        self.ttft = Histogram("mdsl_time_to_first_token_seconds", "Time from submission to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("mdsl_time_per_output_token_seconds",
                              "Per request, the time between its first and last tokens over their number less one.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("mdsl_e2e_request_latency_seconds", "Time from submission to the end of a request.",
                             buckets=E2E_BUCKETS, registry=r)
        self._recent: deque = deque()     # (time, tokens) of the last RATE_WINDOW_S

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def request(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def tokens(self, n: int, now: float) -> None:
        self.generation_tokens.inc(n)
        self._recent.append((now, n))
        self._trim(now)

    def end(self, reason: str, submitted: float, first: Optional[float], last: Optional[float], tokens: int,
            now: float) -> None:
        self.finished.labels(reason).inc()
        self.e2e.observe(now - submitted)
        if first is not None:
            self.ttft.observe(first - submitted)
            if tokens > 1:
                self.tpot.observe((last - first) / (tokens - 1))

    def reject(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def _rate(self) -> float:
        self._trim(time.monotonic())
        return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
