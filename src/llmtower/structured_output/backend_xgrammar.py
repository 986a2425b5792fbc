"""The xgrammar backend: ``StructuredOutputsParams`` -> xgrammar grammar -> compiled grammar
(per tokenizer) -> one ``GrammarMatcher`` per request.

Two levels, as in vLLM: ``validate`` builds the tokenizer-free ``xgrammar.Grammar`` in the
front end (cheap; turns a bad schema, regex or grammar into a ValueError = HTTP 400 before the
request reaches the engine); ``XgrammarBackend.compile`` does the expensive, tokenizer-specific
compile in the engine's thread pool.
"""
from __future__ import annotations

import json
import re
from typing import Any

from llmtower.structured_output.params import StructuredOutputsParams

# JSON schema keywords xgrammar accepts but does not enforce: a schema using them would get
# output that does not validate, so it is refused instead (a 400 naming the keyword).
UNSUPPORTED_JSON_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
    "uniqueItems", "contains", "minContains", "maxContains", "unevaluatedProperties",
    "unevaluatedItems", "multipleOf",
})
# Keywords whose value is a map of name -> subschema, and those whose value is a subschema or
# a list of them: where the walk looks for nested schemas (and nowhere else, so that a property
# *named* "not" is fine).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties", "prefixItems", "anyOf", "oneOf", "allOf",
                  "additionalItems")


def _xgr():
    import xgrammar  # heavy: import on first use only
    return xgrammar


def _message(e: BaseException) -> str:
    """xgrammar's C++ errors start with '[time] /path/file.cc:123: ': keep the reason."""
    text = str(e).strip() or type(e).__name__
    return re.sub(r"^\[[0-9:]+\]\s+\S+:\d+:\s*", "", text.splitlines()[0] if text else text)


def unsupported_json_keywords(schema: Any, path: str = "#") -> list[str]:
    """JSON-pointer-ish paths of the keywords in ``schema`` that xgrammar would not enforce."""
    found: list[str] = []
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k in UNSUPPORTED_JSON_KEYWORDS:
                found.append(f"{path}/{k}")
            elif k in _SCHEMA_MAPS and isinstance(v, dict):
                for name, sub in v.items():
                    found += unsupported_json_keywords(sub, f"{path}/{k}/{name}")
            elif k in _SCHEMA_VALUES:
                subs = v if isinstance(v, list) else [v]
                for i, sub in enumerate(subs):
                    found += unsupported_json_keywords(sub, f"{path}/{k}" + (
                        f"/{i}" if isinstance(v, list) else ""))
    return found


# Printable ASCII without '"' and '\\': a JSON string character needing no escape. (Non-ASCII
# is left out: xgrammar 0.2.9 lets a byte-level model emit invalid UTF-8 inside such a class,
# which decodes to U+FFFD characters and breaks the length bound.)
_PLAIN_CHARS = r'[ !#-\[\]-~]'


def bounded_strings_as_patterns(schema: Any) -> Any:
    """``schema`` with every string's minLength/maxLength turned into an equivalent pattern.

    xgrammar 0.2.9 compiles a length-bounded string to a rule that admits control characters
    (invalid JSON); a pattern of plain printable ASCII characters with the same bounds is a
    valid subset (length-bounded strings are therefore ASCII-only)."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: bounded_strings_as_patterns(sub) for name, sub in v.items()}
        elif k in _SCHEMA_VALUES:
            out[k] = bounded_strings_as_patterns(v)
        else:
            out[k] = v
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not any(k in out for k in ("pattern", "format", "enum", "const"))):
        lo = int(out.pop("minLength", 0))
        hi = out.pop("maxLength", None)
        out["pattern"] = f"^{_PLAIN_CHARS}{{{lo},{'' if hi is None else int(hi)}}}$"
    return out


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(params: StructuredOutputsParams, any_whitespace: bool = False):
    """The tokenizer-free ``xgrammar.Grammar`` of ``params``; ValueError if it is invalid."""
    xgr = _xgr()
    kind = params.kind
    try:
        if kind == "json":
            schema = json.loads(params.spec)
            bad = unsupported_json_keywords(schema)
            if bad:
                raise ValueError(f"the JSON schema uses keyword(s) the grammar engine cannot "
                                 f"enforce: {', '.join(bad[:5])}; remove them from the schema")
            return xgr.Grammar.from_json_schema(json.dumps(bounded_strings_as_patterns(schema)),
                                                any_whitespace=any_whitespace, strict_mode=True)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}',
                                                any_whitespace=any_whitespace, strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice or []))
        return xgr.Grammar.from_ebnf(params.spec)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError from C++ for every bad input
        what = {"json": "the JSON schema is invalid or unsupported",
                "json_object": "json_object failed",
                "regex": "the regex does not compile",
                "choice": "the choice list does not compile",
                "grammar": "the EBNF grammar has an error"}[kind]
        raise ValueError(f"structured_outputs: {what}: {_message(e)}") from None


def validate(params: StructuredOutputsParams) -> None:
    """Raise ValueError (HTTP 400) if ``params`` cannot be compiled; cheap, tokenizer-free."""
    build_grammar(params)


class XgrammarBackend:
    """Owns the xgrammar ``TokenizerInfo`` and ``GrammarCompiler`` of one tokenizer and
    vocabulary; compiles grammars (thread-safe: xgrammar releases the GIL) and makes matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 any_whitespace: bool = False) -> None:
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        # The manager caches compiled grammars by key; xgrammar's own cache would only
        # hold a second copy of each.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1,
                                            cache_enabled=False)

    def compile(self, params: StructuredOutputsParams):
        """The ``CompiledGrammar`` of ``params`` (slow: run it off the busy loop)."""
        ws = self.any_whitespace and not params.disable_any_whitespace
        grammar = build_grammar(params, any_whitespace=ws)
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as e:
            raise ValueError(f"structured_outputs: the grammar does not compile: "
                             f"{_message(e)}") from None

    def new_matcher(self, compiled: Any):
        return _xgr().GrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int):
        """An int32 numpy bitmask of ``rows`` x ceil(vocab / 32) words."""
        import numpy as np
        return np.full((rows, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
