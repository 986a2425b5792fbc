"""Every source file the docs name exists: a newcomer who follows README.md or docs/*.md to a
file finds it there.

Two kinds of mention count:

- a path into the package: ``src/llmtower/engine/llm.py``, ``llmtower/engine/llm.py`` or, as
  the docs mostly write it, ``engine/llm.py`` (a path that starts with one of the package's
  folders and ends in a file name); ``src/llmtower/...`` folders (ending in ``/``) too;
- a folder list: a bare file name in backticks (``block_pool.py``) after a folder
  (``src/llmtower/core/kv_cache/ (`block_pool.py`, ...)``) in the same paragraph, or in a
  section whose heading names the folder (``## How it runs (files under src/llmtower/x/)``).

Paths inside URLs, under ``tests/`` or ``benchmarks/``, globs and module names
(``llmtower.engine.llm``) are not file paths of the package and are left alone.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "llmtower"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

FOLDERS = sorted(p.name for p in PACKAGE.iterdir()
                 if p.is_dir() and (p / "__init__.py").exists())
EXTENSIONS = r"(?:py|c|h|json)"
# Not preceded by a path or word character: that excludes URLs and tests/engine/... paths.
_BOUNDARY = r"(?<![\w./\-])"
_FOLDERS = "|".join(FOLDERS)
FILE_PATH = re.compile(_BOUNDARY + rf"((?:src/)?(?:llmtower/)?(?:{_FOLDERS})/(?:[\w\-]+/)*"
                       rf"[\w\-]+\.{EXTENSIONS})(?![\w/*])")
FOLDER = re.compile(_BOUNDARY + r"((?:src/)?llmtower/(?:[\w\-]+/)+)(?![\w*])")
# Bare names of source files only: a bare `config.json` is a model's file, not the package's.
BARE_FILE = re.compile(r"`([\w\-]+\.(?:py|c|h))`")
HEADING = re.compile(r"^#{1,6} ")


def package_path(token: str) -> Path:
    return PACKAGE / token.removeprefix("src/").removeprefix("llmtower/")


def mentions(text: str) -> list[tuple[int, str, Path]]:
    """(line, as written, the path it names) for every file or folder the text names."""
    found: list[tuple[int, str, Path]] = []
    section_folder: Path | None = None
    paragraph_folder: Path | None = None
    in_code = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if not line.strip():
            paragraph_folder = None
        for m in FILE_PATH.finditer(line):
            found.append((number, m.group(1), package_path(m.group(1))))
        if in_code:
            continue
        folders = list(FOLDER.finditer(line))
        if HEADING.match(line):
            section_folder = package_path(folders[0].group(1)) if len(folders) == 1 else None
            paragraph_folder = None
            found += [(number, m.group(1), package_path(m.group(1))) for m in folders]
            continue
        # Bare names resolve against the last folder named before them.
        events = sorted([(m.start(), "folder", m.group(1)) for m in folders]
                        + [(m.start(), "file", m.group(1)) for m in BARE_FILE.finditer(line)])
        for _, kind, token in events:
            if kind == "folder":
                paragraph_folder = package_path(token)
                found.append((number, token, paragraph_folder))
                continue
            folder = paragraph_folder or section_folder
            if folder is not None:
                found.append((number, token, folder / token))
    return found


def test_every_file_the_docs_name_exists() -> None:
    missing = [f"{doc.relative_to(ROOT)}:{line}: {token} (no {path.relative_to(ROOT)})"
               for doc in DOCS for line, token, path in mentions(doc.read_text())
               if not path.exists()]
    assert not missing, ("the docs name files that do not exist (fix the doc, or the path):\n"
                         + "\n".join(missing))


def test_the_docs_name_files_at_all() -> None:
    # The scan must see the mentions it exists for, or the test above passes on nothing.
    total = sum(len(mentions(doc.read_text())) for doc in DOCS)
    assert total > 50


@pytest.mark.parametrize("text, names", [
    ("see `engine/llm.py` and src/llmtower/server/api_server.py.",
     ["engine/llm.py", "src/llmtower/server/api_server.py"]),
    ("`src/llmtower/core/kv_cache/` (`block_pool.py`, `block_hash.py`)",
     ["src/llmtower/core/kv_cache/", "block_pool.py", "block_hash.py"]),
    ("https://github.com/x/y/blob/main/engine/llm.py and tests/engine/test_llm.py", []),
    ("llmtower.engine.llm, `SamplingParams`, sim/profiles/*.json, a `note.py` alone", []),
    ("## Files under `src/llmtower/sim/`\n\n- `clock.py`: time\n\n## Next\n\n- `x.py`",
     ["src/llmtower/sim/", "clock.py"]),
    ("```\nengine/llm.py `a.py`\n```", ["engine/llm.py"]),
    ("`src/llmtower/sim/profiles/`: its `config.json` is read", ["src/llmtower/sim/profiles/"]),
])
def test_what_counts_as_a_path(text: str, names: list[str]) -> None:
    assert [token for _, token, _ in mentions(text)] == names


def test_bare_names_resolve_against_their_folder() -> None:
    (folder, bare) = mentions("`src/llmtower/sim/` — `clock.py`")
    assert bare[2] == PACKAGE / "sim" / "clock.py" and folder[2] == PACKAGE / "sim"
