"""Chained block hashes for prefix caching.

    block 0            block 1            block 2 (partial: never hashed)
  ┌───────────────┐  ┌───────────────┐  ┌─────────┐
  │ t0 .. t15     │  │ t16 .. t31    │  │ t32 ..  │
  └───────────────┘  └───────────────┘  └─────────┘
  h0 = H(SEED, t0..t15, salt)   h1 = H(h0, t16..t31)

A block's hash covers its own tokens and, through its parent's hash, every token before it,
so equal hashes mean equal prefixes. The cache salt is an extra key of the first block only:
it separates tenants without costing anything on later blocks. blake2b with a 128-bit digest
makes accidental collisions (which would return another prompt's KV) negligible.
"""
from __future__ import annotations

import functools
from array import array
from hashlib import blake2b
from struct import Struct

_ROOT = b"llmtower-root"
# A fresh hasher, copied for each block: cheaper than building one with its parameters.
_EMPTY = blake2b(digest_size=16)


@functools.cache
def _packer(block_size: int) -> Struct:
    """The packer of a block's token ids as native int64s (array("q")'s bytes)."""
    return Struct(f"={block_size}q")


def hash_block(parent: bytes | None, token_ids: list[int] | tuple[int, ...],
               extra_key: str | None = None) -> bytes:
    h = _EMPTY.copy()
    h.update(parent if parent is not None else _ROOT)
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(b"\x00salt\x00" + extra_key.encode())
    return h.digest()


def extend_block_hashes(block_hashes: list[bytes], token_ids: list[int], block_size: int,
                        num_tokens: int, cache_salt: str | None = None) -> None:
    """Hash the full blocks among the first ``num_tokens`` tokens that are not hashed yet.

    Incremental: only blocks after ``len(block_hashes)`` are hashed, so a request's prompt
    is hashed once and each decode block once, when it fills.
    """
    start = len(block_hashes)
    end = num_tokens // block_size
    if start >= end:
        return
    if start == 0:
        parent = hash_block(None, token_ids[:block_size], cache_salt)
        block_hashes.append(parent)
        start = 1
    else:
        parent = block_hashes[-1]
    # The blocks after the first carry no salt: each hash is H(parent || the block's int64
    # tokens), as hash_block computes it.
    pack = _packer(block_size)
    copy = _EMPTY.copy
    append = block_hashes.append
    for i in range(start * block_size, end * block_size, block_size):
        h = copy()
        h.update(parent)
        h.update(pack.pack(*token_ids[i:i + block_size]))
        parent = h.digest()
        append(parent)
