"""Load a model directory's tokenizer with transformers, from local disk only."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """AutoTokenizer over the local directory ``path`` (never a hub). Its ``chat_template`` comes
    from tokenizer_config.json or chat_template.jinja when the model has one."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {path}: expected one of {', '.join(_TOKENIZER_FILES)}")
    if (path / "tokenizer.json").is_file():
        # tokenizer.json defines the tokenizer completely; loading it through the fast class
        # directly skips AutoTokenizer's model-config imports (seconds of start-up) and uses
        # exactly what the file says, whatever model-specific class the config would pick.
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer  # slow import: only when a tokenizer is needed

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
