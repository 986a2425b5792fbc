"""The API process's event loop: uvloop (and uvicorn's httptools parser) where installed,
the standard library's loop with $LLMTOWER_EVENT_LOOP=asyncio, a clear error otherwise."""
from __future__ import annotations

import asyncio

import pytest

from llmtower.server.api_server import EVENT_LOOP_ENV, run_event_loop


def _loop_module(monkeypatch, choice: str | None) -> str:
    if choice is None:
        monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    else:
        monkeypatch.setenv(EVENT_LOOP_ENV, choice)
    seen: list[str] = []

    async def main() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__)
    run_event_loop(main())
    return seen[0]


def test_auto_takes_uvloop_and_asyncio_the_standard_loop(monkeypatch):
    pytest.importorskip("uvloop")
    assert _loop_module(monkeypatch, None).startswith("uvloop")
    assert _loop_module(monkeypatch, "auto").startswith("uvloop")
    assert _loop_module(monkeypatch, "asyncio").startswith("asyncio")


def test_an_unknown_choice_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    main = asyncio.sleep(0)
    with pytest.raises(ValueError, match="'auto' or 'asyncio'"):
        run_event_loop(main)
    main.close()
