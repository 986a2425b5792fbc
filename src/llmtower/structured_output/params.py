"""What a request asks its output to match: exactly one of a JSON schema, any JSON object, a
regular expression, a choice of strings, or an EBNF (GBNF) grammar.

This is plain data with shape checks only (no xgrammar import): it travels inside
``SamplingParams`` from the front end to the engine. Whether a schema, regex or grammar
compiles is checked by ``backend_xgrammar.validate`` in the front end, and again by the
engine's compile.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's ``StructuredOutputsParams`` names).

    ``json``: a JSON schema (a dict, or its JSON text); ``json_object``: any JSON object;
    ``regex``: the whole output matches it; ``choice``: the output is one of these strings;
    ``grammar``: an EBNF/GBNF grammar whose ``root`` rule the output matches.
    ``disable_any_whitespace`` is accepted for vLLM compatibility: JSON is always generated
    without free whitespace between tokens unless the engine says otherwise.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    # Filled by __post_init__: the kind, and the spec as a canonical string (the cache key).
    kind: str = field(default="", compare=False)
    spec: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {what}")
        kind = given[0]
        if kind == "json":
            self.spec = _schema_text(self.json)
        elif kind == "json_object":
            if self.json_object is not True:
                raise ValueError(f"structured_outputs.json_object={self.json_object!r} is "
                                 "invalid: use true")
            self.spec = ""
        elif kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"structured_outputs.regex={self.regex!r} is invalid: give a "
                                 "non-empty regular expression string")
            self.spec = self.regex
        elif kind == "choice":
            c = self.choice
            if not isinstance(c, (list, tuple)) or not c:
                raise ValueError(f"structured_outputs.choice={c!r} is invalid: give a "
                                 "non-empty list of strings")
            if not all(isinstance(s, str) and s for s in c):
                raise ValueError(f"structured_outputs.choice={c!r} is invalid: every choice "
                                 "must be a non-empty string")
            self.choice = list(c)
            self.spec = json.dumps(self.choice)
        else:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError(f"structured_outputs.grammar={self.grammar!r} is invalid: give "
                                 "an EBNF grammar with a root rule, e.g. root ::= \"yes\" | \"no\"")
            self.spec = self.grammar
        self.kind = kind

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: requests with equal keys share one."""
        return (self.kind, self.spec)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "structured_outputs"
                  ) -> StructuredOutputsParams:
        """From a request body's ``structured_outputs`` object; unknown keys are a ValueError
        that names them (never silently ignored)."""
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be an object like {{\"json\": {{...}}}}, "
                             f"{{\"regex\": \"...\"}}, {{\"choice\": [...]}} or "
                             f"{{\"grammar\": \"...\"}}; got {type(d).__name__}")
        allowed = set(KINDS) | {"disable_any_whitespace"}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(f"{where} has unsupported key(s) {', '.join(unknown)}: use one of "
                             f"{', '.join(KINDS)} (and optionally disable_any_whitespace)")
        return cls(**d)


def _schema_text(schema: Any) -> str:
    """A JSON schema as compact JSON text (property order kept: it is the output order)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_outputs.json must be a JSON schema object, got "
                         f"{type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"))
