"""Structured outputs on the default model (SmolLM2-135M-Instruct): valid JSON for a schema,
a regex and a choice, with the real tokenizer's 49152-token vocabulary."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from llmtower.core.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "capital": {"type": "string", "maxLength": 20},
    "population_millions": {"type": "integer", "minimum": 0, "maximum": 2000},
    "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]}},
    "required": ["name", "capital", "population_millions", "continent"]}


@pytest.fixture(scope="module")
def llm():
    from llmtower import LLM
    return LLM(num_threads=1, max_model_len=512, kv_cache_memory="64MiB", seed=0)


def _chat(llm, text, **sp):
    msgs = [[{"role": "user", "content": text.format(c)}] for c in ("France", "Japan", "Kenya")]
    return [o.outputs[0] for o in llm.chat(msgs, SamplingParams(**sp), use_tqdm=False)]


def test_schema_regex_and_choice_on_smollm2(llm):
    for c in _chat(llm, "Describe {} as JSON.", temperature=0.0, max_tokens=120,
                   structured_outputs={"json": SCHEMA}):
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    for c in _chat(llm, "When was {} founded? Answer with a year.", temperature=0.0,
                   max_tokens=10, structured_outputs={"regex": r"[12]\d{3}"}):
        assert re.fullmatch(r"[12]\d{3}", c.text)
    for c in _chat(llm, "Is {} in Europe?", temperature=0.0, max_tokens=10,
                   structured_outputs={"choice": ["Yes", "No"]}):
        assert c.text in ("Yes", "No")
