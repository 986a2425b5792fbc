"""The extra key of a request's first block hash: what, beside its tokens, decides whether two
prefixes may share KV blocks (the cache salt, and the LoRA adapter: the same tokens under two
adapters have different keys and values)."""
from __future__ import annotations

from llmtower.core.request import Request

# Adapter keys start with this character; a cache salt that does too gets a second one, so
# that no salt a client sends can equal an adapter's key.
_MARK = "\x01"


def block_extra_key(request: Request) -> str | None:
    salt = request.cache_salt
    lora = request.lora_request
    if lora is None:
        return _MARK + salt if salt is not None and salt.startswith(_MARK) else salt
    return f"{_MARK}lora{lora.lora_int_id}" + ("" if salt is None else f"\x00{salt}")
