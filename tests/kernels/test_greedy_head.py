"""The greedy output layer (``kernels/greedy_head.c``): its tokens are the argmax of the full
output layer's logits, bit for bit (ties to the first index, bfloat16 rounding included), its
candidates' logits are the full layer's own values, rows it cannot decide are left to the full
layer, and through the engine greedy tokens do not change when it is on."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmtower.kernels import ops
from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.executor import model_runner
from llmtower.kernels import greedy_head as GH
from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.kernels.gemv_bf16 import GemvWeight
from llmtower.kernels.greedy_head import GreedyHead
from llmtower.models import llama
from tests.executor.exactness_helpers import add_greedy, make_engine, random_prompts, run_all
from tests.fixtures.tiny_models import (  # noqa: F401  (pytest finds fixtures by name)
    make_tiny_model_dir,
    tiny_llama_dir,
    tiny_tokenizer_dir,
)

pytestmark = pytest.mark.skipif(ops.capabilities().why_not("greedy_head") is not None,
                                reason=f"no greedy head here: {ops.capabilities().why_not('greedy_head')}")
DTYPES = [torch.bfloat16, torch.float32]


def _model_screens(dtype: str) -> bool:
    """Whether a model in ``dtype`` takes the screen here: it needs the output layer's decode
    kernel, whose sums it repeats (bfloat16: gemv_bf16, AVX512_BF16 only; float32: gemm_f32)."""
    return ops.capabilities().can_run("gemv_bf16" if dtype == "bfloat16" else "gemm_f32")


def _head(w: torch.Tensor, path: int = 0) -> tuple[GreedyHead, GemvWeight | GemmF32Weight]:
    kernel = GemvWeight(w) if w.dtype == torch.bfloat16 else GemmF32Weight(w)
    return GreedyHead(w, kernel, path), kernel


def _full_argmax(kernel, x: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    logits = kernel(x).float()
    return np.argmax(logits.numpy(), axis=-1), logits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(3000, 576), (777, 75), (64, 32), (130, 2)])
@pytest.mark.parametrize("path", [0, 1])
def test_tokens_are_the_full_layers_argmax(dtype, n, k, path):
    """Random layers of odd sizes, 1 to the most rows of inputs of different scales (some
    made to point at one row, as a model's do): the token is the full logits' argmax, and each
    candidate's logit is the full layer's value to the bit."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    head, kernel = _head(w, path)
    decided = 0
    rows = [1, 2, 3, 4, 5, 6, 7, 8, 13, 37, 64, GH.max_rows()]
    rows = [r for r in rows if r <= head.max_rows]
    for trial in range(40):
        m = rows[trial % len(rows)]
        x = torch.randn(m, k, generator=g) * float(torch.rand(1, generator=g) * 20 + 0.1)
        if trial % 3 == 0:
            x[0] = w[(trial * 7) % n].float() * 40 + 0.1 * x[0]
        x = x.to(dtype)
        want, logits = _full_argmax(kernel, x)
        got = head.tokens(x)
        decided += int((got >= 0).sum())
        assert np.array_equal(got[got >= 0], want[got >= 0])
        for r in np.flatnonzero(got >= 0):
            ids, vals = head.candidates(int(r))
            assert want[r] in ids
            assert torch.equal(logits[r, torch.from_numpy(ids)], torch.from_numpy(vals))
    assert decided > 0.9 * sum(rows[t % len(rows)] for t in range(40))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_first_index(dtype):
    """Two equal rows: the first wins. In bfloat16, a row whose float32 sum is larger but
    rounds to the same bfloat16 logit loses to the earlier one, as argmax over the full
    (rounded) logits decides; in float32 the larger sum wins."""
    k = 64
    base = torch.zeros(500, k)
    base[:, 2:] = torch.randn(500, k - 2, generator=torch.Generator().manual_seed(0)) * 0.01
    x = torch.zeros(1, k, dtype=dtype)
    x[0, 0], x[0, 1] = 1.0, 2.0 ** -10
    equal = base.clone()
    equal[37] = equal[310] = 0.0
    equal[37, 0] = equal[310, 0] = 1.0
    rounded = base.clone()
    rounded[50] = rounded[60] = 0.0
    rounded[50, 0] = 4.0
    # float32 4.0039..., bfloat16 4.0; its int8 copy is exact, so only the rounding margin
    # keeps row 50 among the candidates
    rounded[60, :2] = torch.tensor([4.0, 4.0])
    for w, want in ((equal, 37), (rounded, 50 if dtype == torch.bfloat16 else 60)):
        head, kernel = _head(w.to(dtype))
        full, _ = _full_argmax(kernel, x)
        assert head.tokens(x).tolist() == full.tolist() == [want]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_the_screen_underrates_still_win(dtype):
    """Rows whose screened logit is below another row's but whose true logit is above it:
    the bound's two error terms keep them among the candidates (each gap is wider than the
    bfloat16 rounding margin). B's weight 2^-8 rounds to 0 in its int8 copy (the |e| |h|
    term); C's input 0.01 rounds to 0 beside an input of 1000 (the s |q| |d| term)."""
    k = 8
    w = torch.zeros(300, k)
    w[5, 0] = 1.0 + 2.0 ** -5        # A: exact in int8, logit 1.03125
    w[9, :2] = torch.tensor([1.0, 2.0 ** -8])  # B: int8 sees 1.0; true 1 + 16 * 2^-8 = 1.0625
    x = torch.zeros(1, k)
    x[0, :2] = torch.tensor([1.0, 16.0])
    head, kernel = _head(w.to(dtype))
    full, _ = _full_argmax(kernel, x.to(dtype))
    assert head.tokens(x.to(dtype)).tolist() == full.tolist() == [9]
    w = torch.zeros(300, k)
    w[20, 2] = 0.0005                 # D: 1000 * 0.0005 = 0.5
    w[30, 3] = 100.0                  # C: 100 * 0.01 = 1.0, screened as 0
    x = torch.zeros(1, k)
    x[0, 2:4] = torch.tensor([1000.0, 0.01])
    head, kernel = _head(w.to(dtype))
    full, _ = _full_argmax(kernel, x.to(dtype))
    assert head.tokens(x.to(dtype)).tolist() == full.tolist() == [30]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_it_cannot_decide_are_left_to_the_full_layer(dtype):
    """inf / NaN inputs give -1 for that row only; so does a row with more candidates than
    the cap (an all-zero input ties every logit); below the cap the ties resolve exactly."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(3000, 96, generator=g) * 0.05).to(dtype)
    head, kernel = _head(w)
    x = torch.randn(4, 96, generator=g).to(dtype)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3] = 0
    got = head.tokens(x)
    want, _ = _full_argmax(kernel, x[:1])
    assert got.tolist() == [int(want[0]), -1, -1, -1]
    huge = w.float().clone()
    huge[11] = 1e37  # its logit (9.6e38) overflows float32: the full layer decides
    huge_head, huge_kernel = _head(huge.to(dtype))
    x = torch.ones(1, 96, dtype=dtype)
    assert huge_head.tokens(x).tolist() == [-1]
    small_w = (torch.randn(300, 96, generator=g) * 0.05).to(dtype)
    small, _ = _head(small_w)
    assert small.tokens(torch.zeros(1, 96, dtype=dtype)).tolist() == [0]  # all tie: the first
    head.cap = 1
    x = torch.randn(2, 96, generator=g).to(dtype)
    x[1] = w[7].float() * 50  # one clear winner
    got = head.tokens(x)
    assert got[0] in (-1, _full_argmax(kernel, x[:1])[0][0]) and got[1] == 7
    assert got[0] == -1 or int(head.num_cand[0]) == 1


def _masked_argmax(logits: torch.Tensor, allow: np.ndarray) -> np.ndarray:
    """xgrammar's own masking (disallowed tokens to -inf), then the sampler's argmax."""
    import xgrammar
    target = logits.clone()
    xgrammar.apply_token_bitmask_inplace(target, torch.from_numpy(allow),
                                         vocab_size=target.shape[1])
    return np.argmax(target.numpy(), axis=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", [0, 1])
def test_grammar_bitmasks_are_applied_as_xgrammar_applies_them(dtype, path):
    """Rows under a random bitmask, one allowing a single token, one allowing every token (no
    grammar), one allowing none (left to the full layer, whose logits are all -inf): the
    tokens are the masked full logits' argmax, the row's best allowed token even where its
    overall best is disallowed."""
    g = torch.Generator().manual_seed(11)
    n, k = 1003, 96  # the last tile's 43 columns: 5 vectors of 8 and 3 one by one
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    head, kernel = _head(w, path)
    words = -(-n // 32)
    for trial in range(6):
        x = torch.randn(5, k, generator=g)
        x[0] = w[40].float() * 30  # its best token, 40, is disallowed below
        x = x.to(dtype)
        bits = torch.randint(0, 2, (5, words * 32), generator=g).bool().numpy()
        bits[0, 40] = False
        bits[1] = False
        bits[1, 977 - trial] = True
        bits[2] = True
        bits[3] = False
        allow = np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy()
        logits = kernel(x).float()
        want = _masked_argmax(logits, allow)
        got = head.tokens(x, allow)
        assert got[3] == -1 and want[3] == 0
        assert got[:3].tolist() + got[4:].tolist() == want[:3].tolist() + want[4:].tolist()
        assert got[1] == 977 - trial and got[0] != 40
    with pytest.raises(ValueError, match="token bitmask"):
        head.tokens(x, allow[:, :-1].copy())


def test_bad_inputs_are_refused():
    w = torch.randn(200, 64).to(torch.bfloat16)
    head, _ = _head(w)
    for bad in (torch.randn(1, 64), torch.randn(1, 63).to(torch.bfloat16),
                torch.randn(0, 64).to(torch.bfloat16),
                torch.randn(head.max_rows + 1, 64).to(torch.bfloat16),
                torch.randn(64).to(torch.bfloat16),
                torch.randn(2, 128).to(torch.bfloat16)[:, ::2]):
        with pytest.raises(ValueError, match="greedy head: x must be"):
            head.tokens(bad)
    with pytest.raises(ValueError, match="like its kernel copy"):
        GreedyHead(w.float(), GemvWeight(w))
    bad_w = w.clone()
    bad_w[3, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        GreedyHead(bad_w, GemvWeight(bad_w))


def test_greedy_tokens_fall_back_to_the_full_layer(tiny_llama_dir):
    """The model's greedy_tokens: rows the screen leaves (-1) get the full logits' argmax."""
    core = make_engine(tiny_llama_dir, dtype="float32")
    model = core.executor.runner.model  # type: ignore[attr-defined]
    assert model.greedy_head is not None and model.greedy_rows() == GH.max_rows() == 256
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    x[1, 0] = float("nan")
    got = model.greedy_tokens(x)
    want = np.argmax(model._logits(x).numpy(), axis=-1)
    assert got.tolist() == want.tolist()


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory, tiny_tokenizer_dir):
    """Four layers (the whole decode step runs in one C call), untied output layer."""
    return make_tiny_model_dir(tmp_path_factory, "qwen2", tokenizer_dir=tiny_tokenizer_dir,
                               num_layers=4, tie=False, seed=7)


def _tokens(model_dir, dtype: str, screen: bool, monkeypatch, requests) -> tuple[dict, int]:
    """Each request's tokens, and how many steps took the screen."""
    monkeypatch.setattr(model_runner, "GREEDY_SCREEN", screen)
    calls = []
    real = llama.LlamaForCausalLM.greedy_tokens

    def record(self, hidden, allow=None):
        calls.append(hidden.shape[0])
        return real(self, hidden, allow)

    monkeypatch.setattr(llama.LlamaForCausalLM, "greedy_tokens", record)
    core = make_engine(model_dir, dtype=dtype, num_threads=2)
    for rid, prompt, sp in requests:
        core.add_request(EngineCoreRequest(rid, prompt, sp, eos_token_id=2))
    return run_all(core), len(calls)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model", ["tiny_llama_dir", "four_layer_dir"])
def test_engine_tokens_do_not_change(request, monkeypatch, dtype, model):
    """Greedy requests (12 at once, finishing one by one), beside a sampled one and one asking
    for logprobs: the same tokens with the screen on and off, and the screen took only the
    steps where every row is plain greedy."""
    model_dir = request.getfixturevalue(model)
    prompts = random_prompts(12, 3, 40, seed=4)
    reqs = [(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    reqs.append(("sampled", prompts[0], SamplingParams(temperature=0.8, seed=3, max_tokens=20,
                                                         ignore_eos=True)))
    reqs.append(("logprobs", prompts[1], SamplingParams(temperature=0.0, logprobs=2,
                                                          max_tokens=2, ignore_eos=True)))
    on, used = _tokens(model_dir, dtype, True, monkeypatch, reqs)
    off, unused = _tokens(model_dir, dtype, False, monkeypatch, reqs)
    assert on == off
    assert unused == 0
    assert used == 0  # a sampled request runs beside the greedy ones in every step
    alone = [(rid, p, sp) for rid, p, sp in reqs[:3]] + [reqs[-1]]
    on, used = _tokens(model_dir, dtype, True, monkeypatch, alone)
    off, _ = _tokens(model_dir, dtype, False, monkeypatch, alone)
    assert on == off
    # once the logprobs request finished (2 tokens): 3 plain greedy rows
    assert (used > 0) == _model_screens(dtype)
    many, used_many = _tokens(model_dir, dtype, True, monkeypatch, reqs[:12])
    many_off, _ = _tokens(model_dir, dtype, False, monkeypatch, reqs[:12])
    assert many == many_off
    assert (used_many > 0) == _model_screens(dtype)


def test_screen_tokens_equal_full_logits_on_greedy_runs(tiny_llama_dir, monkeypatch):
    """The test helpers' plain greedy run: identical token streams, screen on and off."""
    outs = []
    for screen in (True, False):
        monkeypatch.setattr(model_runner, "GREEDY_SCREEN", screen)
        core = make_engine(tiny_llama_dir, dtype="bfloat16", num_threads=2)
        add_greedy(core, random_prompts(5, 3, 30, seed=9), 20)
        outs.append(run_all(core))
    assert outs[0] == outs[1]


def test_structured_greedy_tokens_do_not_change(tiny_llama_dir, monkeypatch):
    """Greedy requests under a regex, a JSON schema and a choice beside plain greedy ones: the
    same text with the screen on and off, and the screen took the grammar steps."""
    from llmtower import LLM
    from llmtower.structured_output import StructuredOutputsParams

    calls: list[bool] = []
    real = llama.LlamaForCausalLM.greedy_tokens

    def record(self, hidden, allow=None):
        calls.append(allow is not None)
        return real(self, hidden, allow)

    monkeypatch.setattr(llama.LlamaForCausalLM, "greedy_tokens", record)
    llm = LLM(model=str(tiny_llama_dir), num_threads=2, max_model_len=256,
              kv_cache_memory="16MiB", seed=0)
    schema = {"type": "object", "properties": {"id": {"type": "integer"},
                                               "name": {"type": "string", "maxLength": 8}},
              "required": ["id", "name"]}
    cases = [{"regex": r"(cat|dog)s? [a-z]{1,8}!"}, {"json": schema},
             {"choice": ["positive", "negative", "neutral"]}, None]
    prompts = ["Hello world", "The quick brown fox", "What is the capital of France?", "12"]
    texts = []
    for screen in (True, False):
        monkeypatch.setattr(model_runner, "GREEDY_SCREEN", screen)
        sps = [SamplingParams(temperature=0.0, max_tokens=40,
                              structured_outputs=None if c is None else
                              StructuredOutputsParams(**c)) for c in cases]
        outs = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, sps)]
        outs += [o.outputs[0] for o in llm.generate(prompts, sps, use_tqdm=False)]
        texts.append([(o.text, o.finish_reason) for o in outs])
    assert texts[0] == texts[1]
    assert any(calls)  # grammar rows took the screen with their bitmasks


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_min_tokens_masks_and_top_p_keep_the_screen_exact(tiny_llama_dir, monkeypatch,
                                                          dtype):
    """Greedy rows with top-p / top-k (which never drop the top token) and with min_tokens
    holding back stop tokens that greedy would emit: the screen takes them, with the stop
    tokens masked while min_tokens is unmet, and the tokens equal the sampler's."""
    prompts = random_prompts(4, 3, 20, seed=12)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base, _ = _tokens(tiny_llama_dir, dtype, False, monkeypatch,
                      [(f"b{i}", p, plain) for i, p in enumerate(prompts)])
    reqs = [(f"m{i}", p, SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6,
                                         stop_token_ids=base[f"b{i}"][:3], top_p=0.9, top_k=5))
            for i, p in enumerate(prompts)]
    on, used = _tokens(tiny_llama_dir, dtype, True, monkeypatch, reqs)
    off, _ = _tokens(tiny_llama_dir, dtype, False, monkeypatch, reqs)
    assert on == off
    assert (used > 0) == _model_screens(dtype)
    for i in range(len(prompts)):  # greedy's own first token is a stop token: held back
        assert on[f"m{i}"][0] != base[f"b{i}"][0]
        assert len(on[f"m{i}"]) >= 6
