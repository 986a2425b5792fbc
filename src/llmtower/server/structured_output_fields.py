"""The HTTP request surfaces of structured outputs, read into one ``StructuredOutputsParams``.

A request may ask in one of these ways (vLLM's names): ``structured_outputs={...}``, the older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields, or OpenAI's
``response_format`` (``json_object``, ``json_schema``). Asking in two ways at once, an
unsupported backend or whitespace pattern, and a spec that does not compile are ValueErrors
(HTTP 400) that say what to change — never silently ignored.
"""
from __future__ import annotations

from typing import Any

from llmtower.structured_output.backend_xgrammar import validate
from llmtower.structured_output.params import StructuredOutputsParams

GUIDED_FIELDS = ("json", "regex", "choice", "grammar")


def structured_outputs_of(req: Any) -> StructuredOutputsParams | None:
    """The constraint a /v1/completions or /v1/chat/completions body asks for, validated."""
    sources: list[tuple[str, StructuredOutputsParams]] = []
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        sources.append(("structured_outputs", StructuredOutputsParams.from_dict(so)))
    guided: dict[str, Any] = {k: getattr(req, f"guided_{k}", None) for k in GUIDED_FIELDS}
    guided = {k: v for k, v in guided.items() if v is not None}
    for k, v in guided.items():
        sources.append((f"guided_{k}", StructuredOutputsParams(**{k: v})))
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        sources.append(("response_format", _response_format(rf)))
    backend = getattr(req, "guided_decoding_backend", None)
    if backend not in (None, "", "auto", "xgrammar"):
        raise ValueError(f"guided_decoding_backend={backend!r} is not available: this server "
                         "uses xgrammar; leave it out or use 'xgrammar'")
    if getattr(req, "guided_whitespace_pattern", None):
        raise ValueError("guided_whitespace_pattern is not supported (xgrammar has no "
                         "whitespace pattern); leave it out")
    if len(sources) > 1:
        raise ValueError(f"the request asks for structured output in {len(sources)} ways ("
                         f"{', '.join(name for name, _ in sources)}): give only one")
    if not sources:
        return None
    params = sources[0][1]
    validate(params)
    return params


def _response_format(rf: Any) -> StructuredOutputsParams:
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.type == "json_schema":
        js = rf.json_schema
        schema = getattr(js, "schema_", None) if js is not None else None
        if schema is None:
            raise ValueError("response_format json_schema needs json_schema.schema, e.g. "
                             "{\"type\": \"json_schema\", \"json_schema\": {\"name\": \"x\", "
                             "\"schema\": {...}}}")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format type {rf.type!r} is not supported; use 'text', "
                     "'json_object' or 'json_schema'")
