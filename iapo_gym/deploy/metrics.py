"""``serve``'s ``GET /metrics``: its requests in the Prometheus text format (``prometheus-client``).

``ServeMetrics.observe`` reads each access record as the access log is written (``app.AccessLog``'s observer:
the record of every completion request, answered or refused), so the metrics count exactly what the access log
holds, also without ``--access-log``. Each server process keeps its own (with ``--workers K``, scrape each, or sum
them): a Prometheus counter is a running total, and its rate over any window (``rate(...[5m])`` in PromQL) is the
spend per window.

- ``iapo_serve_requests_total{status, context}``: completion requests by HTTP status and context;
- ``iapo_serve_arm_choices_total{context, prompt, n}``: the arm each answered request was served with;
- ``iapo_serve_completions_drawn_total{context, prompt}`` and ``iapo_serve_completions_saved_total{context,
  prompt}``: completions drawn, and those the arm's N would have drawn but early stopping saved (N - drawn);
- ``iapo_serve_tokens_total{kind}``: upstream ``prompt`` and ``completion`` tokens of the answered requests;
- ``iapo_serve_request_seconds{status_class}``: the latency of the completion requests (``2xx``, ``4xx``, ``5xx``);
- ``iapo_serve_in_flight`` and ``iapo_serve_queued``: requests answered and waiting now;
- with ``serve --learn``: ``iapo_serve_learn_chosen`` and ``iapo_serve_learn_explored``, the requests the learner
  chose an arm for and, of them, those it explored (their ratio is the exploration share, at most
  ``--explore-share``).

A context label is one of the policy's context names, or ``weights`` for a request that named weights (so a
caller cannot grow the label set); a prompt label is one of the policy's prompt ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS", "ServeMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
#: Upper bounds (seconds) of the latency histogram's buckets.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
WEIGHTS = "weights"  # the context label of a request that named weights rather than a context
OTHER = "other"  # a prompt id that is not the policy's (never expected)


class ServeMetrics:
    """The metrics of one ``serve`` process (module docstring), in a registry of their own."""

    def __init__(self, contexts: Iterable[str], prompts: Iterable[str],
                 in_flight: Callable[[], float] | None = None, queued: Callable[[], float] | None = None) -> None:
        """``contexts`` and ``prompts``: the policy's names, the only label values taken from a request;
        ``in_flight``, ``queued``: read at each scrape."""
        self.contexts, self.prompts = frozenset(contexts), frozenset(prompts)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("iapo_serve_requests", "Completion requests by HTTP status and context",
                                ("status", "context"), registry=r)
        self.arms = Counter("iapo_serve_arm_choices", "Answered requests by the arm served (context, prompt, N)",
                            ("context", "prompt", "n"), registry=r)
        self.drawn = Counter("iapo_serve_completions_drawn", "Completions drawn from the upstream",
                             ("context", "prompt"), registry=r)
        self.saved = Counter("iapo_serve_completions_saved", "Completions of the arm's N that early stopping saved",
                             ("context", "prompt"), registry=r)
        self.tokens = Counter("iapo_serve_tokens", "Upstream tokens of the answered requests", ("kind",), registry=r)
        self.latency = Histogram("iapo_serve_request_seconds", "Latency of the completion requests",
                                 ("status_class",), buckets=LATENCY_BUCKETS, registry=r)
        if in_flight is not None:
            Gauge("iapo_serve_in_flight", "Requests being answered", registry=r).set_function(in_flight)
        if queued is not None:
            Gauge("iapo_serve_queued", "Requests waiting for a slot", registry=r).set_function(queued)

    def learning(self, chosen: Callable[[], float], explored: Callable[[], float]) -> None:
        """Expose ``serve --learn``'s counts, read at each scrape: requests chosen for and explored."""
        Gauge("iapo_serve_learn_chosen", "Requests serve --learn chose an arm for", registry=self.registry
              ).set_function(chosen)
        Gauge("iapo_serve_learn_explored", "Requests serve --learn served another arm than the greedy one",
              registry=self.registry).set_function(explored)

    def _context(self, name: Any) -> str:
        if name is None:
            return "none"  # refused before its context was known
        return str(name) if name in self.contexts else WEIGHTS

    def observe(self, record: dict[str, Any]) -> None:
        """Count one access record (``serve``'s: status, latency_ms, context, prompt, n, drawn, tokens)."""
        status = int(record.get("status", 0))
        context = self._context(record.get("context"))
        self.requests.labels(str(status), context).inc()
        if "latency_ms" in record:
            self.latency.labels(f"{status // 100}xx").observe(float(record["latency_ms"]) / 1000.0)
        prompt = record.get("prompt")
        if prompt is None or "drawn" not in record:
            return
        prompt = str(prompt) if prompt in self.prompts else OTHER
        n, drawn = int(record.get("n", 0)), int(record["drawn"])
        self.arms.labels(context, prompt, str(n)).inc()
        self.drawn.labels(context, prompt).inc(drawn)
        self.saved.labels(context, prompt).inc(max(0, n - drawn))
        self.tokens.labels("prompt").inc(int(record.get("prompt_tokens", 0)))
        self.tokens.labels("completion").inc(int(record.get("completion_tokens", 0)))

    def exposition(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return bytes(generate_latest(self.registry))
