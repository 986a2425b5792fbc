"""The HTTP families vLLM's dashboards read (``prometheus_fastapi_instrumentator``'s names):
``http_requests_total{handler,method,status}``, ``http_request_duration_seconds{handler,
method}`` and ``http_request_duration_highr_seconds``, measured by a plain ASGI middleware.

``handler`` is the matched route's path template (``/v1/completions``), never the raw path,
so that scanners probing random URLs cannot grow the label set: unmatched paths count as
``none``. ``status`` is grouped (``2xx``, ``4xx``, ...) as the instrumentator does by default.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

DURATION_BUCKETS = [0.1, 0.5, 1.0]  # the instrumentator's default for the labelled histogram
HIGHR_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0,
                 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0]


class HTTPMetrics:
    """Owns the HTTP families of one server's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("http_requests", "HTTP requests by handler, method and status.",
                                ["handler", "method", "status"], registry=registry)
        self.duration = Histogram("http_request_duration_seconds",
                                  "HTTP request duration (until the last byte of the response).",
                                  ["handler", "method"], buckets=DURATION_BUCKETS,
                                  registry=registry)
        self.duration_highr = Histogram("http_request_duration_highr_seconds",
                                        "HTTP request duration, fine buckets, no labels.",
                                        buckets=HIGHR_BUCKETS, registry=registry)

    def observe(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(handler, method, f"{status // 100}xx").inc()
        self.duration.labels(handler, method).observe(seconds)
        self.duration_highr.observe(seconds)


class StatusWatch:
    """Owns the HTTP status an ASGI app answered with: an ASGI ``send`` that passes every
    message on and notes the status of ``http.response.start``. ``status`` keeps ``default``
    until the app answers (an app that fails first, or a client that left)."""

    def __init__(self, send, default: int) -> None:
        self.send = send
        self.status = default

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)


class HTTPMetricsMiddleware:
    """ASGI middleware that times every HTTP request into ``HTTPMetrics``. Streaming
    responses are timed until their last chunk."""

    def __init__(self, app, metrics: HTTPMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        watch = StatusWatch(send, 500)  # 500: what the client sees if the app fails first
        try:
            await self.app(scope, receive, watch)
        finally:
            route = scope.get("route")
            handler = getattr(route, "path", None) or "none"
            self.metrics.observe(handler, scope.get("method", ""), watch.status,
                                 time.perf_counter() - start)
