"""`llmtower serve` thread settings: CPUs it may not use are refused before anything starts,
and `serve --help` says how threads behave."""
from __future__ import annotations

import pytest

from llmtower.cli.main import main


def test_serve_refuses_cpu_bind_outside_the_affinity(monkeypatch, capsys):
    monkeypatch.delenv("LLMTOWER_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    assert main(["serve", "--cpu-bind", "0-7", "--port", "9"]) == 2
    err = capsys.readouterr().err
    assert "--cpu-bind 0-7: CPU(s) 2-7 are outside this process's affinity (0-1" in err
    assert "Traceback" not in err


def test_serve_refuses_a_bad_bind_variable(monkeypatch, capsys):
    monkeypatch.setenv("LLMTOWER_CPU_OMP_THREADS_BIND", "0-x")
    assert main(["serve", "--port", "9"]) == 2
    assert "is not a CPU number or range" in capsys.readouterr().err


def test_serve_help_explains_threads(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--cpu-bind" in out and "sheds threads while other processes are runnable" in out
