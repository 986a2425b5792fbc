"""`llmtower preload` and `llmtower ctl` without a server to talk to: every bad input and an
unreachable server end with one clear line and a non-zero status, never a traceback."""
from __future__ import annotations

from llmtower.cli.main import main

NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing listens there


def test_preload_refuses_missing_empty_and_unreadable_files(tmp_path, capsys):
    assert main(["preload", "--prompts-file", str(tmp_path / "none.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["preload", "--prompts-file", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 1}\n{oops\n')
    assert main(["preload", "--prompts-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:1: 'prompt' must be a non-empty string" in err
    assert f"{bad}:2: not valid JSON" in err and "no prompt of the file could be read" in err


def test_an_unreachable_server_is_one_line(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("hello\n")
    assert main(["preload", "--prompts-file", str(f), "--url", NOWHERE, "--timeout", "2"]) == 1
    assert "cannot reach the server" in capsys.readouterr().err
    for cmd in (["ctl", "defrag"], ["ctl", "unpin"]):
        assert main([*cmd, "--url", NOWHERE, "--timeout", "2"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"llmtower {' '.join(cmd)}: error: cannot reach the server")
