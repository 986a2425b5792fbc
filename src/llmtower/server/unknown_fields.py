"""Unknown request fields are refused, not ignored: a misspelt or unsupported extension
(``guided_jsn``, a backend-specific option) would otherwise give a 200 with an answer that
silently lacks what was asked for. The 400 names the fields."""
from __future__ import annotations

from typing import Any

# OpenAI bookkeeping fields with no effect on generation: accepted and ignored.
IGNORED_OPENAI_FIELDS = frozenset({"metadata", "store", "service_tier"})


def reject_unknown_fields(model_cls: Any, data: Any) -> Any:
    """A pydantic before-validator body: raise ValueError naming unknown keys of ``data``."""
    if not isinstance(data, dict):
        return data
    known = set(IGNORED_OPENAI_FIELDS)
    for name, f in model_cls.model_fields.items():
        known.add(name)
        if f.alias:
            known.add(f.alias)
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(repr(k) for k in unknown[:10])}: this "
                         "server does not support them; remove them or check their spelling")
    return data
