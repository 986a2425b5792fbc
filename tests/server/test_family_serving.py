"""Every model family beyond Llama served by `llmtower serve` with its own published chat
template (tests/fixtures/chat_templates/: Gemma 2 and 3, Mixtral, Qwen1.5-MoE, Qwen3-MoE,
OLMoE, OLMo 2, Granite 3.3, SmolLM3, gpt-oss), its tokenizer's markers as special tokens and
generation_config.json's EOS ids (tests/fixtures/family_chat.py); one server per family, a
group of them started side by side at a time. A chat completion's prompt is the template's rendering as transformers
renders it, its greedy reply is transformers' (float32), the family's turn-end
tokens stop it, the templates' own switches (SmolLM3's /think and /no_think, Qwen3's
enable_thinking, gpt-oss's reasoning_effort) reach them, a gpt-oss answer in harmony comes
back as its final channel's text, and the sliding-window families serve a context far past
their windows."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_process import ServerProcess
from tests.fixtures.family_chat import FAMILY_CHAT, HARMONY_REPLY, build_family_chat_model

MESSAGES = [{"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo"},
            {"role": "user", "content": "Why?"}]
# Gemma 2's template refuses a system message (test_gemma2_refuses_a_system_message).
FAMILY_MESSAGES = {"gemma2": MESSAGES[1:]}
MAX_TOKENS = 6
MAX_MODEL_LEN = 512
SERVER_ARGS = ["--num-threads", "1", "--max-model-len", str(MAX_MODEL_LEN),
               "--num-gpu-blocks", "160"]

CHATML_TAIL = ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
               "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")
TULU_TAIL = "<|user|>\nHi\n<|assistant|>\nYo<|endoftext|>\n<|user|>\nWhy?\n<|assistant|>\n"
# The end of each family's rendering of its messages: its own markers, as its template lays
# them out (what comes before holds the date in some: they are checked against transformers).
TAILS = {
    "gemma2": ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nYo"
               "<end_of_turn>\n<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n"),
    "gemma3": ("<bos><start_of_turn>user\nBe terse.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
               "Yo<end_of_turn>\n<start_of_turn>user\nWhy?<end_of_turn>\n"
               "<start_of_turn>model\n"),
    "mixtral": "<s> [INST] Be terse.\n\nHi [/INST] Yo</s> [INST] Why? [/INST]",
    "qwen2_moe": "<|im_start|>system\nBe terse.<|im_end|>\n" + CHATML_TAIL,
    "qwen3_moe": "<|im_start|>system\nBe terse.<|im_end|>\n" + CHATML_TAIL,
    "olmoe": "<|endoftext|><|system|>\nBe terse.\n" + TULU_TAIL,
    "olmo2": "<|endoftext|><|system|>\nBe terse.\n" + TULU_TAIL,
    "granite": ("<|start_of_role|>system<|end_of_role|>Be terse.<|end_of_text|>\n"
                "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n"
                "<|start_of_role|>assistant<|end_of_role|>Yo<|end_of_text|>\n"
                "<|start_of_role|>user<|end_of_role|>Why?<|end_of_text|>\n"
                "<|start_of_role|>assistant<|end_of_role|>"),
    "smollm3": ("Reasoning Mode: /think\n\n## Custom Instructions\n\nBe terse.\n\n"
                + CHATML_TAIL),
    "gpt_oss": ("Reasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel "
                "must be included for every message.<|end|><|start|>developer<|message|>"
                "# Instructions\n\nBe terse.\n\n<|end|><|start|>user<|message|>Hi<|end|>"
                "<|start|>assistant<|channel|>final<|message|>Yo<|end|><|start|>user<|message|>"
                "Why?<|end|><|start|>assistant"),
}
# Served a group at a time, the group's servers started side by side: a server's processes
# (API, engine) take ~600 MB together, too much for the whole list at once.
GROUPS = (("gemma2", "gemma3", "gpt_oss", "mixtral", "qwen2_moe"),
          ("qwen3_moe", "olmoe", "olmo2", "granite", "smollm3"))
FAMILIES = [f for group in GROUPS for f in group]
assert sorted(FAMILIES) == sorted(FAMILY_CHAT)
WINDOWED = {"gemma2": 16, "gemma3": 16, "gpt_oss": 16}  # test_families.py's windows
# The family a test runs on is a module-scoped parameter: pytest runs one family's tests
# together, so each group's servers start once.
each_family = pytest.mark.parametrize("family", FAMILIES, indirect=True, scope="module")


def _messages(family: str) -> list[dict[str, str]]:
    return FAMILY_MESSAGES.get(family, MESSAGES)


class FamilyServers:
    """Owns the running servers: those of one group of families at a time."""

    def __init__(self, tmp_path_factory, tokenizer_dir: Path) -> None:
        self.tmp = tmp_path_factory
        self.tokenizer_dir = tokenizer_dir
        self.running: dict[str, tuple[Path, ServerProcess]] = {}

    def get(self, family: str) -> tuple[Path, ServerProcess]:
        """``family``'s model folder and running server (its group's started if need be)."""
        if family not in self.running:
            self.stop()
            group = next(g for g in GROUPS if family in g)
            for f in group:
                path = build_family_chat_model(self.tmp.mktemp(f), self.tokenizer_dir, f)
                server = ServerProcess(["--model", str(path), "--served-model-name", f,
                                        *SERVER_ARGS],
                                       self.tmp.mktemp(f"serve-{f}") / "server.log")
                self.running[f] = (path, server.launch())
            with ThreadPoolExecutor(len(group)) as pool:
                for ready in [pool.submit(s.wait_ready) for _, s in self.running.values()]:
                    ready.result()
        return self.running[family]

    def stop(self) -> None:
        for _, server in self.running.values():
            server.stop()
        self.running.clear()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_tokenizer_dir):
    s = FamilyServers(tmp_path_factory, tiny_tokenizer_dir)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def served(family, servers) -> tuple[Path, ServerProcess]:
    """The family's model folder and its running server."""
    return servers.get(family)


def _chat(server: ServerProcess, family: str, **extra) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": family, "messages": _messages(family), "max_tokens": MAX_TOKENS,
        "temperature": 0, "return_token_ids": True, **extra})


def _tokenizer(path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


@each_family
def test_chat_uses_the_family_template_and_equals_transformers(family, served):
    """The prompt the engine sees is the family template's rendering (its markers one token
    each), and the greedy reply is transformers' (float32, EOS ignored), ids and text."""
    from llmtower.server.reasoning import get_reasoning_parser
    from tests.executor.exactness_helpers import hf_greedy

    path, server = served
    tok = _tokenizer(path)
    rendered = tok.apply_chat_template(_messages(family), add_generation_prompt=True,
                                       tokenize=False)
    assert rendered.endswith(TAILS[family])  # the family's own markers
    expected_prompt = tok(rendered, add_special_tokens=False)["input_ids"]
    for marker in FAMILY_CHAT[family].special:  # each one token, as in the real tokenizer
        if marker in rendered:
            assert tok.convert_tokens_to_ids(marker) in expected_prompt

    r = _chat(server, family, ignore_eos=True)
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    if body["prompt_token_ids"] != expected_prompt:  # the templates' date may have turned over
        rendered = tok.apply_chat_template(_messages(family), add_generation_prompt=True,
                                           tokenize=False)
        expected_prompt = tok(rendered, add_special_tokens=False)["input_ids"]
    assert body["prompt_token_ids"] == expected_prompt  # what the engine saw
    assert body["usage"]["prompt_tokens"] == len(expected_prompt)
    (reply_ids,) = hf_greedy(path, [expected_prompt], MAX_TOKENS)
    assert body["choices"][0]["token_ids"] == reply_ids
    if family == "gpt_oss":  # harmony: the channels split, without the markers
        raw = tok.decode(reply_ids, skip_special_tokens=False)
        reasoning, content = get_reasoning_parser("openai_gptoss").extract_reasoning(raw)
        assert (message.get("reasoning_content"), message["content"]) == (reasoning, content)
    else:
        assert message["content"] == tok.decode(reply_ids, skip_special_tokens=True)
        assert "reasoning_content" not in message


@each_family
def test_the_family_turn_end_tokens_stop_the_reply(family, served):
    """generation_config.json's EOS ids (Gemma's <end_of_turn>, Qwen's <|endoftext|>,
    gpt-oss's <|call|>) stop a reply as the tokenizer's EOS does."""
    path, server = served
    tok = _tokenizer(path)
    chat = FAMILY_CHAT[family]
    stop = tok.convert_tokens_to_ids((chat.stops or (tok.eos_token,))[-1])
    r = _chat(server, family, logit_bias={str(stop): 100})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] in ([stop], [])
    assert not choice["message"]["content"]


def only(*families: str):
    return pytest.mark.parametrize("family", families, indirect=True, scope="module")


@only("gemma2")
def test_gemma2_refuses_a_system_message(served):
    r = httpx.post(f"{served[1].base_url}/v1/chat/completions", timeout=60, json={
        "model": "gemma2", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert "System role not supported" in r.json()["error"]["message"]


# The templates' own switches: request -> what the rendered prompt holds, and how it ends.
SWITCHES = {
    # SmolLM3: a /no_think flag in the system prompt, or enable_thinking false, turns thinking
    # off (an empty think block opens the reply); the flag is cut from the instructions.
    "smollm3": [
        ({"messages": [{"role": "system", "content": "Be terse. /no_think"}, *MESSAGES[1:]]},
         ["Reasoning Mode: /no_think\n\n## Custom Instructions\n\nBe terse.\n\n",
          "<|im_start|>assistant\n<think>\n\n</think>\n"]),
        ({"chat_template_kwargs": {"enable_thinking": False}},
         ["Reasoning Mode: /no_think", "<|im_start|>assistant\n<think>\n\n</think>\n"]),
    ],
    "qwen3_moe": [({"chat_template_kwargs": {"enable_thinking": False}},
                   ["<|im_start|>user\nWhy?<|im_end|>\n",
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n"])],
    "gpt_oss": [({"chat_template_kwargs": {"reasoning_effort": "high"}},
                 ["Reasoning: high\n\n", "<|start|>assistant"]),
                ({"reasoning_effort": "low"}, ["Reasoning: low\n\n", "<|start|>assistant"])],
}


@only(*SWITCHES)
def test_template_switches_reach_the_template(family, served):
    path, server = served
    tok = _tokenizer(path)
    for extra, (inside, tail) in SWITCHES[family]:
        r = _chat(server, family, **{"max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        prompt = tok.decode(r.json()["prompt_token_ids"])
        assert inside in prompt and prompt.endswith(tail), (extra, prompt[-200:])


@only("gpt_oss")
def test_gpt_oss_returns_its_final_channel(served):
    """The served gpt-oss model is scripted to answer as gpt-oss does (family_chat.
    script_harmony_reply): its final-channel text is the content, without markers or
    channel names, whole and streamed, and the reply stops at <|return|>."""
    _, server = served
    answer = HARMONY_REPLY.split("<|message|>")[1].split("<|return|>")[0]
    r = _chat(server, "gpt_oss", max_tokens=32)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == answer
    assert "reasoning_content" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    parts: dict[str, str] = {"reasoning_content": "", "content": ""}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": "gpt_oss", "messages": MESSAGES, "max_tokens": 32, "temperature": 0,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                for key in parts:
                    parts[key] += delta.get(key) or ""
    assert parts == {"reasoning_content": "", "content": answer}


@only(*WINDOWED)
def test_max_model_len_is_not_capped_by_the_sliding_window(family, served):
    """A model whose layers attend over 16-token windows serves --max-model-len 512, and
    prompts far past its window."""
    path, server = served
    config = json.loads((path / "config.json").read_text())
    assert config["sliding_window"] == WINDOWED[family]
    models = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
    assert models[0]["max_model_len"] == MAX_MODEL_LEN
    long_chat = [{"role": "user", "content": "Tell me more. " * 30}]
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": family, "messages": long_chat, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 8 * WINDOWED[family]
