"""Structured outputs end to end on a tiny random-weight model (offline LLM, real sampler):
a random model would almost never produce valid JSON by chance, so every valid output is the
grammar's doing."""
from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmtower.core.sampling_params import SamplingParams
from llmtower.structured_output import StructuredOutputsParams

EXAMPLES = int(os.environ.get("LLMTOWER_HYPOTHESIS_EXAMPLES", "12"))
PROMPTS = ["Hello world", "The quick brown fox", "What is the capital of France?",
           "Numbers like 12 and 345"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from llmtower import LLM
    return LLM(model=str(tiny_llama_dir), num_threads=1, max_model_len=512,
               kv_cache_memory="16MiB", seed=0)


def _gen(llm, prompts, **sp):
    return [o.outputs[0] for o in llm.generate(prompts, SamplingParams(**sp), use_tqdm=False)]


# ------------------------------------------------------------------ JSON schemas (hypothesis)
NAMES = st.sampled_from(["id", "name", "age", "tags", "ok", "x", "kind", "items"])
LEAVES = st.one_of(
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
              st.integers(0, 3), st.integers(0, 5)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 200)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", "blue", 1, 2, True]), min_size=1, max_size=4,
             unique=True).map(lambda e: {"enum": e}),
)


def _object(children):
    return st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req}))


def _array(children):
    return st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                               "maxItems": lo + extra},
                     children, st.integers(0, 2), st.integers(0, 2))


SCHEMAS = st.recursive(LEAVES, lambda c: st.one_of(_object(c), _array(c)), max_leaves=6)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=_object(SCHEMAS), seed=st.integers(0, 2**16))
def test_hypothesis_schemas_always_validate(llm, schema, seed):
    outs = _gen(llm, PROMPTS[:2], temperature=1.0, seed=seed, max_tokens=400,
                structured_outputs=StructuredOutputsParams(json=schema))
    for c in outs:
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


# ------------------------------------------------------------------ regex, choice, grammar
@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"(cat|dog)s? [a-z]{1,8}!",
                                     r"[A-Z][a-z]{2,6}( [A-Z][a-z]{2,6}){0,2}"])
def test_regex_outputs_fullmatch(llm, pattern):
    for temp in (0.0, 1.0):
        for c in _gen(llm, PROMPTS, temperature=temp, seed=1, max_tokens=60,
                      structured_outputs={"regex": pattern}):
            assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c.text


def test_choice_outputs_are_members(llm):
    choices = ["positive", "negative", "neutral", "a \"quoted\" one"]
    for c in _gen(llm, PROMPTS * 2, temperature=1.0, seed=3, max_tokens=30,
                  structured_outputs={"choice": choices}):
        assert c.finish_reason == "stop" and c.text in choices


def test_ebnf_grammar(llm):
    grammar = 'root ::= "(" expr ")"\nexpr ::= [0-9]+ (("+" | "*") [0-9]+)*'
    for c in _gen(llm, PROMPTS, temperature=1.0, seed=5, max_tokens=60,
                  structured_outputs={"grammar": grammar}):
        assert c.finish_reason == "stop" and re.fullmatch(r"\(\d+([+*]\d+)*\)", c.text), c.text


def test_json_object_gives_a_json_object(llm):
    for c in _gen(llm, PROMPTS, temperature=0.0, max_tokens=300,
                  structured_outputs={"json_object": True}):
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:  # a random model may nest forever: the prefix is still an object's
            assert c.finish_reason == "length" and c.text.startswith("{")


def test_permissive_grammar_gives_the_unconstrained_greedy_tokens(llm):
    # A regex admitting every string admits every token sequence that decodes to valid UTF-8
    # text: on those, masking must not change a single greedy token. (A random model also
    # emits lone UTF-8 continuation bytes, which no text grammar admits: those are skipped.)
    prompts = [f"{a} {b}" for a in ("Hello", "The", "What", "A", "Key", "Numbers")
               for b in ("world", "fox", "capital", "model", "value", "cat", "sun", "dog")]
    plain = _gen(llm, prompts, temperature=0.0, max_tokens=10)
    tok = llm.get_tokenizer()
    texts = [p for p, c in zip(prompts, plain)
             if "\ufffd" not in tok.decode(c.token_ids, skip_special_tokens=False)
             and not set(c.token_ids) & {0, 1}]
    assert len(texts) >= 3
    # Constrained and unconstrained requests in one batch: each row gets its own mask.
    sps = [SamplingParams(temperature=0.0, max_tokens=10,
                          structured_outputs={"regex": r"[\s\S]*"} if i % 2 == 0 else None)
           for i in range(len(texts))]
    mixed = [o.outputs[0] for o in llm.generate(texts, sps, use_tqdm=False)]
    expected = {p: c.token_ids for p, c in zip(prompts, plain)}
    assert [c.token_ids for c in mixed] == [expected[p] for p in texts]


def test_jump_forward_outputs_are_valid(tiny_llama_dir):
    from llmtower import LLM
    llm = LLM(model=str(tiny_llama_dir), num_threads=1, max_model_len=512,
              kv_cache_memory="16MiB", seed=0, structured_outputs_jump_forward=True)
    schema = {"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 5},
                                               "last_name": {"type": "string", "maxLength": 5},
                                               "is_admin": {"type": "boolean"}},
              "required": ["first_name", "last_name", "is_admin"]}
    outs = _gen(llm, PROMPTS, temperature=1.0, seed=2, max_tokens=200,
                structured_outputs={"json": schema})
    for c in outs:
        jsonschema.validate(json.loads(c.text), schema)
    assert llm.engine_core.scheduler.structured_output.num_forced_tokens > 0


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("so,message", [
    ({"json": {"type": "foo"}}, "JSON schema is invalid"),
    ({"json": {"type": "array", "uniqueItems": True}}, "#/uniqueItems"),
    ({"regex": "a(b"}, "regex does not compile"),
    ({"grammar": "root ::= \"a\" |"}, "EBNF grammar has an error"),
    ({"choice": []}, "non-empty list"),
    ({"json": "{not json"}, "not valid JSON"),
])
def test_bad_specs_are_value_errors(llm, so, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _gen(llm, PROMPTS[:1], structured_outputs=so)
    assert _gen(llm, PROMPTS[:1], max_tokens=3)[0].token_ids  # the engine still serves
