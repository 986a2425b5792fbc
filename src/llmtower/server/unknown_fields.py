"""Request fields the server does not know: ignored with one warning line naming them (vLLM's
behaviour, so that clients sending newer OpenAI fields keep working), or refused with a 400
that names them under ``--reject-unknown-fields`` (a misspelt extension such as ``guided_jsn``
then fails loudly instead of answering without what was asked for).

The choice is per app, but pydantic validators are per class: a small ASGI middleware sets
a context variable for the requests of a strict app, and the validator reads it."""
from __future__ import annotations

import contextvars
import logging
from typing import Any

logger = logging.getLogger(__name__)

# OpenAI bookkeeping fields with no effect on generation: accepted silently.
IGNORED_OPENAI_FIELDS = frozenset({"metadata", "store", "service_tier"})

# True while a request of an app started with --reject-unknown-fields is being handled.
_strict: contextvars.ContextVar[bool] = contextvars.ContextVar("reject_unknown_fields",
                                                               default=False)


def unknown_field_names(model_cls: Any, data: dict) -> list[str]:
    """The keys of ``data`` that are neither fields (or aliases) of ``model_cls`` nor
    OpenAI's bookkeeping fields, sorted."""
    fields = model_cls.model_fields
    unknown = [str(k) for k in data
               if k not in fields and k not in IGNORED_OPENAI_FIELDS]
    if unknown:  # aliases only matter when a key is not a field's own name
        aliases = {f.alias for f in fields.values() if f.alias}
        unknown = [k for k in unknown if k not in aliases]
    return sorted(unknown)


def reject_unknown_fields(model_cls: Any, data: Any) -> Any:
    """A pydantic before-validator body: unknown keys of ``data`` are logged and ignored, or
    (strict app) a ValueError naming them, which the server answers with a 400."""
    if not isinstance(data, dict):
        return data
    unknown = unknown_field_names(model_cls, data)
    if unknown:
        ignore_or_refuse(unknown, model_cls.__name__)
    return data


def ignore_or_refuse(unknown: list[str], where: str, hint: str = "") -> None:
    """Log one warning naming the unknown fields of ``where`` (they are then ignored), or in a
    strict app raise a ValueError naming them (with ``hint``, what the object does have)."""
    named = ", ".join(repr(k) for k in unknown[:10])
    if _strict.get():
        raise ValueError(f"{where}: unknown field(s) {named}{hint}: this server does not "
                         "support them; remove them or check their spelling")
    logger.warning("request fields ignored (unknown to %s): %s", where, named)


class RejectUnknownFieldsMiddleware:
    """--reject-unknown-fields: the requests of this app refuse unknown fields (400)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        token = _strict.set(True)
        try:
            return await self.app(scope, receive, send)
        finally:
            _strict.reset(token)
