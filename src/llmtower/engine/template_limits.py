"""A time limit on rendering a chat template.

Jinja's sandbox stops a template from reaching Python internals, but not from looping:
three nested ``range(100000)`` loops run for days. A template compiled by Jinja is Python
code whose file name is ``<template>``; while one renders, a trace function on the rendering
thread checks a deadline at every line of template code and raises once it has passed. Only
template frames are traced, so the model's own template renders at nearly full speed.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

# Long enough for any real conversation (a 4,096-message chat renders in milliseconds).
DEFAULT_RENDER_TIMEOUT_S = 5.0
_TEMPLATE_FILES = frozenset({"<template>", "<unknown>"})


class TemplateTimeoutError(ValueError):
    """A chat template ran past its time limit (HTTP 400: the request's template or
    arguments made it loop)."""


def call_with_render_deadline(fn: Callable[..., T], *args: Any,
                              timeout_s: float = DEFAULT_RENDER_TIMEOUT_S, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on this thread, with every Jinja template it renders stopped
    by TemplateTimeoutError after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s

    def local_trace(_frame: FrameType, event: str, _arg: Any) -> Any:
        if event == "line" and time.monotonic() > deadline:
            raise TemplateTimeoutError(
                f"the chat template did not finish rendering within {timeout_s:g} s; it "
                "loops too long for these messages and arguments")
        return local_trace

    def global_trace(frame: FrameType, _event: str, _arg: Any) -> Any:
        if frame.f_code.co_filename in _TEMPLATE_FILES:
            return local_trace
        return None

    previous = sys.gettrace()
    sys.settrace(global_trace)
    try:
        return fn(*args, **kwargs)
    finally:
        sys.settrace(previous)
