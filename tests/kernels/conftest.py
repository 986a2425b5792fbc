"""Starts the per-level kernel test runs (tests/kernels/isa_runs.py) in the background once
pytest has collected test_isa_levels.py's level tests, so their library builds and tests overlap
the rest of the suite; and ends a child still running when the session does."""
from __future__ import annotations

import pytest

from tests.kernels import isa_runs


def pytest_collection_finish(session: pytest.Session) -> None:
    levels = []
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "originalname", None) == isa_runs.TEST_NAME and callspec is not None:
            level = callspec.params["level"]
            if level not in levels and isa_runs.why_skipped(level) is None:
                levels.append(level)
    if levels:
        isa_runs.start(levels)


def pytest_sessionfinish() -> None:
    isa_runs.stop()
