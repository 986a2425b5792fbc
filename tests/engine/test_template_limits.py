"""Issue 11, item 5: a chat template that loops forever is stopped by its time limit, and the
model's own template still renders (and fast)."""
from __future__ import annotations

import time

import pytest

from llmtower.engine.template_limits import (
    TemplateTimeoutError,
    call_with_render_deadline,
)

NESTED_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}"
                "{% for k in range(100000) %}{% endfor %}{% endfor %}{% endfor %}x")


def test_a_template_with_nested_loops_stops_at_its_deadline(tokenizer):
    start = time.monotonic()
    with pytest.raises(TemplateTimeoutError, match="did not finish rendering within 0.5 s"):
        call_with_render_deadline(tokenizer.apply_chat_template,
                                  [{"role": "user", "content": "hi"}], tokenize=False,
                                  chat_template=NESTED_LOOPS, timeout_s=0.5)
    assert time.monotonic() - start < 3


def test_the_models_template_renders_unchanged_under_the_limit(tokenizer):
    messages = [{"role": "user", "content": "hello"}] * 200
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert call_with_render_deadline(tokenizer.apply_chat_template, messages,
                                     tokenize=False) == plain
