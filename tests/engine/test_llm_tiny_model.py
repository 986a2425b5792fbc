"""The offline LLM end to end on a tiny random-weight Llama model: real model, real sampler."""
from __future__ import annotations

import pytest

from llmtower.core.errors import AdmissionError
from llmtower.core.sampling_params import SamplingParams

pytest.importorskip("llmtower.engine.factory",
                    reason="llmtower.engine.factory.create_engine_core is not built yet")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from llmtower import LLM
    return LLM(model=str(tiny_llama_dir), num_threads=1, max_model_len=128,
               kv_cache_memory="8MiB", seed=0)


def test_generate_returns_text(llm):
    prompts = ["Hello world", "The quick brown fox jumps over", "What is the capital of France?"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    tok = llm.get_tokenizer()
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert c.text and c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert o.metrics is not None and o.metrics.ttft > 0


def test_n2_samples_differ_and_seeds_reproduce(llm):
    sp = SamplingParams(n=2, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    (a,) = llm.generate("Hello world", sp, use_tqdm=False)
    (b,) = llm.generate("Hello world", sp, use_tqdm=False)
    assert [c.index for c in a.outputs] == [0, 1]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_chat_and_stop_string(llm):
    conv = [{"role": "user", "content": "Hello world"}]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (free,) = llm.chat(conv, sp, use_tqdm=False)
    assert free.prompt.endswith("<|im_start|>assistant\n")
    text = free.outputs[0].text
    assert len(text) > 4
    stop = text[len(text) // 2:len(text) // 2 + 2]
    (cut,) = llm.chat(conv, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                           stop=[stop]), use_tqdm=False)
    assert cut.outputs[0].text == text[:text.index(stop)]
    assert cut.outputs[0].stop_reason == stop
    assert not llm.engine_core.has_unfinished_requests()


def test_prompt_too_long(llm):
    with pytest.raises(AdmissionError, match="max_model_len"):
        llm.generate([[5] * 200], use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()


def test_stop_string_finish_reports_engine_queue_time_and_preemptions(tiny_llama_dir):
    """A stop string ends a request in the client, not the engine; its metrics must still carry
    the engine's queue time and preemption count."""
    from llmtower import LLM

    # 12 blocks of 4 tokens for 6 prompts that each grow to ~30 tokens: preemptions happen.
    small = LLM(model=str(tiny_llama_dir), num_threads=1, max_model_len=64, block_size=4,
                num_gpu_blocks=12, seed=0)
    prompts = [f"Prompt number {i} says hello" for i in range(6)]
    free = small.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in free) > 0
    tok = small.get_tokenizer()
    # the text of output tokens 14-15: late (after preemptions) but before the engine's end
    stops = [tok.decode(o.outputs[0].token_ids[:16])[len(tok.decode(o.outputs[0].token_ids[:14])):]
             for o in free]
    outs = small.generate(prompts, [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                   stop=[s] if s else []) for s in stops],
                          use_tqdm=False)
    by_string = [(o, f) for o, f in zip(outs, free)
                 if o.outputs[0].stop_reason in stops and len(o.outputs[0].token_ids) < 20]
    assert len(by_string) >= 3
    assert sum(o.metrics.num_preemptions for o, _ in by_string) > 0
    assert all(o.metrics.queue_time > 0 for o, _ in by_string)
    assert all(o.metrics.e2e_latency >= o.metrics.ttft >= o.metrics.queue_time for o, _ in by_string)
