"""What every test shares: engines built with ``--dtype auto`` (the default) run in float32,
the dtype that is token-exact against transformers, whatever this CPU multiplies natively;
tests of the auto rule itself clear it (tests/test_utils.py). Set in the environment so that
the `llmtower serve` processes the server tests start follow it too."""
from __future__ import annotations

import os

from llmtower.utils import AUTO_DTYPE_ENV

os.environ.setdefault(AUTO_DTYPE_ENV, "float32")
