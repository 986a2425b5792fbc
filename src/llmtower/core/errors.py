"""Errors the core raises at admission; the server maps each to an HTTP status."""
from __future__ import annotations


class AdmissionError(ValueError):
    """The request can never run (too long for the context or the whole KV cache): HTTP 400."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured limit; retry later: HTTP 429."""
