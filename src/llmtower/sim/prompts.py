"""Token ids for trace requests that give only a prompt length.

The scheduler needs real token ids: prefix caching hashes them. Each request gets random ids,
except that requests of one ``prefix_group`` start with the same ``prefix_len`` ids, so their
prefixes hit the cache exactly as a shared system prompt would. Ids are drawn in [0, 255]
(valid in any vocabulary; CPython shares those int objects, so 100k in-flight prompts cost
pointers, not integers) and are made only when a request arrives, so a long trace never holds
all its prompts at once. Random 16-token blocks of such ids collide with probability 256^-16.
"""
from __future__ import annotations

import random

from llmtower.sim.workload import TraceRequest


class PromptFactory:
    """Owns the random streams of prompt ids: one for unique tokens, consumed in submission
    order, and one per prefix group, so equal seeds give equal prompts."""

    def __init__(self, seed: int = 0, default_prefix_len: int = 256) -> None:
        self.seed = seed
        self.default_prefix_len = default_prefix_len
        self._rng = random.Random(f"{seed}/prompts")
        self._groups: dict[str, tuple[random.Random, bytearray]] = {}

    def _prefix(self, group: str, n: int) -> bytes:
        entry = self._groups.get(group)
        if entry is None:
            entry = self._groups[group] = (random.Random(f"{self.seed}/prefix/{group}"), bytearray())
        rng, buf = entry
        if len(buf) < n:
            buf.extend(rng.randbytes(n - len(buf)))
        return bytes(buf[:n])

    def token_ids(self, tr: TraceRequest) -> list[int]:
        enc = self.encoded(tr)
        return enc if isinstance(enc, list) else list(enc)

    def encoded(self, tr: TraceRequest) -> bytes | list[int]:
        """The prompt as ``token_ids`` gives it, generated ones still as bytes (one id each):
        what a sharded run sends its workers, at C speed."""
        if tr.prompt_token_ids is not None:
            return tr.prompt_token_ids
        n = tr.prompt_len
        if tr.prefix_group is None:
            return self._rng.randbytes(n)
        plen = self.default_prefix_len if tr.prefix_len is None else tr.prefix_len
        plen = min(plen, n)
        return self._prefix(tr.prefix_group, plen) + self._rng.randbytes(n - plen)
