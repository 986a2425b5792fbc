"""Grammar-constrained decoding (structured outputs), coupled with the scheduler.

- ``params.StructuredOutputsParams``: what a request asks for (JSON schema, any JSON object,
  regex, choice, EBNF grammar); light, travels inside ``SamplingParams``.
- ``backend_xgrammar``: compiles those into xgrammar grammars and matchers.
- ``manager.StructuredOutputManager``: owned by the scheduler; compiles off the busy loop in a
  thread pool with a cache by key, builds one token bitmask per step, advances the matchers.
- ``bitmask.apply_grammar_bitmask``: the model runner's hook, applied to the logits before
  sampling.
"""
from llmtower.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
