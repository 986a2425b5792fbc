"""The prompts file of ``llmtower preload --prompts-file`` and ``serve --preload-prompts``.

One prompt per line, either plain text or a JSON object (JSONL):

    You are a helpful assistant for ACME's billing questions.
    {"prompt": "a text prompt, which may hold\\nnewlines"}
    {"messages": [{"role": "system", "content": "You are ..."}]}

``messages`` go through the chat template without the generation prompt (the KV of the
conversation so far is what later conversations share), unless the object says
``"add_generation_prompt": true``. Blank lines are skipped. A line that cannot be read is
reported with its number, and the other lines are still preloaded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PreloadItem:
    """One prompt of the file: its line number and either text or chat messages."""

    line: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = False

    def to_json(self) -> dict[str, Any]:
        if self.messages is not None:
            return {"messages": self.messages, "add_generation_prompt": self.add_generation_prompt}
        return {"prompt": self.prompt}


@dataclass
class PromptsFile:
    """What a prompts file holds: the prompts that could be read and one error per bad line."""

    items: list[PreloadItem] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_item(obj: Any, line: int) -> PreloadItem:
    """A JSON object of the file (or of the admin endpoint's body) as a PreloadItem; raises
    ValueError saying what is wrong with it."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object with 'prompt' or 'messages', got "
                         f"{type(obj).__name__}")
    unknown = sorted(set(obj) - {"prompt", "messages", "add_generation_prompt"})
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}: use 'prompt' or 'messages' "
                         "(and optionally 'add_generation_prompt')")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError("give exactly one of 'prompt' (text) or 'messages' (a chat)")
    agp = obj.get("add_generation_prompt", False)
    if not isinstance(agp, bool):
        raise ValueError("'add_generation_prompt' must be true or false")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError("'prompt' must be a non-empty string")
        return PreloadItem(line, prompt=obj["prompt"])
    msgs = obj["messages"]
    if (not isinstance(msgs, list) or not msgs
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                       and isinstance(m.get("content"), str) for m in msgs)):
        raise ValueError("'messages' must be a non-empty list of {\"role\": ..., \"content\": "
                         "...} objects with string values")
    return PreloadItem(line, messages=msgs, add_generation_prompt=agp)


def read_prompts_file(path: str | Path) -> PromptsFile:
    """Read a prompts file. Raises FileNotFoundError / ValueError when there is nothing to
    preload at all (missing, unreadable or empty file); bad lines are collected as errors."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompts file {str(p)!r} does not exist (or is not a file)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts file {str(p)!r} is not UTF-8 text: {e}") from None
    out = PromptsFile()
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if not line.startswith("{"):
            out.items.append(PreloadItem(n, prompt=raw.rstrip("\r")))
            continue
        try:
            out.items.append(parse_item(json.loads(line), n))
        except json.JSONDecodeError as e:
            out.errors.append(f"{p}:{n}: not valid JSON ({e.msg} at column {e.colno}); a line "
                              "starting with '{' must be one JSON object")
        except ValueError as e:
            out.errors.append(f"{p}:{n}: {e}")
    if not out.items and not out.errors:
        raise ValueError(f"prompts file {str(p)!r} is empty: put one prompt per line (text, or "
                         "JSON with 'prompt' or 'messages')")
    return out
