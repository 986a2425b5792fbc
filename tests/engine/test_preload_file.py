"""The prompts file of `llmtower preload` / `serve --preload-prompts`: text lines, JSONL with
'prompt' or 'messages', and every bad input named by its line while the others are kept."""
from __future__ import annotations

import pytest

from llmtower.engine.preload_file import read_prompts_file


def test_text_and_jsonl_lines_with_their_line_numbers(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text('You are a billing assistant.\n\n'
                 '{"prompt": "two\\nlines"}\n'
                 '{"messages": [{"role": "system", "content": "Be brief."}]}\n'
                 '{"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": true}\n')
    pf = read_prompts_file(f)
    assert not pf.errors
    assert [it.line for it in pf.items] == [1, 3, 4, 5]
    assert pf.items[0].prompt == "You are a billing assistant."
    assert pf.items[1].prompt == "two\nlines"
    assert pf.items[2].messages == [{"role": "system", "content": "Be brief."}]
    assert not pf.items[2].add_generation_prompt and pf.items[3].add_generation_prompt


def test_malformed_lines_are_named_and_the_others_kept(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('first\n{"prompt": "ok"\n{"messages": []}\n{"prompt": "a", "messages": []}\n'
                 '{"promt": "typo"}\n[1, 2]\nlast\n')
    pf = read_prompts_file(f)
    assert [it.line for it in pf.items] == [1, 6, 7]  # "[1, 2]" is a text prompt
    assert len(pf.errors) == 4
    assert pf.errors[0].startswith(f"{f}:2: not valid JSON")
    assert pf.errors[1].startswith(f"{f}:3: 'messages' must be a non-empty list")
    assert pf.errors[2].startswith(f"{f}:4: give exactly one of")
    assert pf.errors[3].startswith(f"{f}:5: unknown field(s) promt")


def test_missing_and_empty_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_prompts_file(tmp_path / "nope.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="is empty"):
        read_prompts_file(empty)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_prompts_file(binary)
