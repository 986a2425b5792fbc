"""The on-disk cache of GGUF files described as Hugging Face directories: config, tokenizer and
the GGUF's location (``gguf_convert.write_gguf_model_dir``; the weights are read from the GGUF
itself). Rebuilding the tokenizer from the metadata takes about a second, so it is done once. Each
GGUF gets ``$XDG_CACHE_HOME/llmtower/<name>-<key>/`` (default ``~/.cache/llmtower``), where the
key hashes the GGUF's size and mtime and the converter version, so a changed file or converter
gets a fresh directory. A directory is built under a temporary name and renamed into place, so a
process never sees a half-written one, and two processes converting at once both end up using
whichever finished first.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import time
from pathlib import Path

from llmtower.models.gguf_convert import CONVERTER_VERSION, write_gguf_model_dir
from llmtower.utils import cache_root, cache_tmpdir

logger = logging.getLogger(__name__)

_STALE_TMP_SECONDS = 3600


def cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    text = f"{st.st_size}:{st.st_mtime_ns}:v{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cached_dir_path(gguf_path: str | Path, name: str | None = None) -> Path:
    """Where the converted directory of ``gguf_path`` lives (whether or not it exists yet)."""
    gguf_path = Path(gguf_path)
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", name or gguf_path.stem).strip("-.") or "model"
    return cache_root() / f"{label}-{cache_key(gguf_path)}"


def cached_hf_dir(gguf_path: str | Path, name: str | None = None) -> Path:
    """The Hugging Face directory converted from ``gguf_path``, converting it on first use."""
    gguf_path = Path(gguf_path)
    final = cached_dir_path(gguf_path, name)
    if final.is_dir():
        return final
    root = final.parent
    tmp = cache_tmpdir(root, f".{final.name}.tmp-", "model")
    _remove_stale_tmp_dirs(root, final.name, keep=tmp)
    logger.info("reading the config and tokenizer of %s into %s (first use only)", gguf_path, final)
    start = time.perf_counter()
    try:
        write_gguf_model_dir(gguf_path, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished the same conversion first: use its directory.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return final


def _remove_stale_tmp_dirs(root: Path, final_name: str, keep: Path) -> None:
    """Drop temporary directories that crashed conversions left behind (an hour old or more)."""
    now = time.time()
    for tmp in root.glob(f".{final_name}.tmp-*"):
        try:
            if tmp != keep and now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # another process removed it meanwhile
