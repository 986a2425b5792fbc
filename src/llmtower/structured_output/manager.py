"""StructuredOutputManager: the scheduler's partner for grammar-constrained requests.

Following vLLM v1:
  - a request's grammar is compiled off the busy loop, in a thread pool; compiled grammars are
    cached by key (kind + canonical spec), so the second request with the same schema pays
    nothing, and requests arriving while it compiles share the one compile;
  - until its grammar is ready a request waits in ``WAITING_FOR_GRAMMAR``, outside the waiting
    queue, so it blocks nobody; the scheduler moves it into the queue once ``poll`` says so;
  - each step the scheduler asks for one token bitmask over the constrained requests that
    sample in that step; the model runner applies it to the logits before sampling;
  - ``update_from_output`` advances each matcher with the accepted tokens (only tokens newly
    appended, so a recomputed request never advances twice) and finishes a request whose
    grammar has terminated;
  - jump-forward (optional): where the grammar allows exactly one continuation, its tokens are
    appended without sampling and the scheduler computes them like a chunk of prompt.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmtower.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class StructuredOutputsConfig:
    """Engine-wide settings of structured outputs (``--structured-outputs-*`` flags)."""

    compile_timeout_s: float = 5.0
    max_workers: int = 2
    cache_size: int = 256
    any_whitespace: bool = False
    jump_forward: bool = False

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ValueError(f"structured_outputs_compile_timeout={self.compile_timeout_s} is "
                             "invalid: give a number of seconds > 0")
        if self.max_workers < 1 or self.cache_size < 1:
            raise ValueError("structured outputs need at least one compile worker and a cache "
                             "of at least one grammar")


class _Compile:
    """One compile in the cache: its future, and when a worker started it (for the timeout)."""

    __slots__ = ("future", "started")

    def __init__(self) -> None:
        self.future: cf.Future | None = None
        self.started = 0.0


class GrammarState:
    """Owns one request's grammar: the shared compile it waits for, then its own matcher."""

    __slots__ = ("key", "compile", "matcher", "submitted", "num_forced_tokens")

    def __init__(self, key: tuple[str, str], compile: _Compile, submitted: float) -> None:
        self.key = key
        self.compile = compile
        self.matcher: Any = None
        self.submitted = submitted
        self.num_forced_tokens = 0  # tokens appended by jump-forward (for metrics)


class StructuredOutputManager:
    """Owns the grammar backend (built lazily in a worker: loading the tokenizer takes time),
    the compile thread pool, the cache of compiled grammars, and the per-step bitmask."""

    def __init__(self, config: StructuredOutputsConfig,
                 backend_factory: Callable[[], Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._backend_factory = backend_factory
        self._backend: Any = None
        self._backend_lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(config.max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], _Compile] = OrderedDict()
        self.clock = clock
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.num_forced_tokens = 0

    # ------------------------------------------------------------------ compile
    @property
    def backend(self) -> Any:
        if self._backend is not None:
            return self._backend
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def _compile(self, entry: _Compile, params: StructuredOutputsParams) -> Any:
        backend = self.backend  # the first time: loads the tokenizer (not the grammar's fault)
        entry.started = self.clock()
        return backend.compile(params)

    def add_request(self, req: Any) -> bool:
        """Start (or share) the compile of ``req``'s grammar; True if it is ready now. Raises
        ValueError if the same grammar already failed to compile."""
        params: StructuredOutputsParams = req.sampling_params.structured_outputs
        key = params.key
        entry = self._cache.get(key)
        if entry is None:
            entry = _Compile()
            self.num_compiles += 1
            self._cache[key] = entry
            if len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)  # least recently used
            entry.future = self._pool.submit(self._compile, entry, params)
        else:
            self.num_cache_hits += 1
            self._cache.move_to_end(key)
        req.structured_output = GrammarState(key, entry, self.clock())
        return self._try_ready(req)

    def _try_ready(self, req: Any) -> bool:
        state: GrammarState = req.structured_output
        fut = state.compile.future
        assert fut is not None  # add_request submits the compile before it asks
        if not fut.done():
            return False
        exc = fut.exception()
        if exc is not None:
            self._cache.pop(state.key, None)  # let a later request try again
            raise ValueError(str(exc)) if not isinstance(exc, ValueError) else exc
        state.matcher = self.backend.new_matcher(fut.result())
        return True

    def poll(self, waiting: dict[str, Any]) -> tuple[list[Any], list[tuple[Any, str]]]:
        """Of the requests waiting for their grammar: (ready ones, (failed one, why))."""
        ready: list[Any] = []
        failed: list[tuple[Any, str]] = []
        now = self.clock()
        timeout = self.config.compile_timeout_s
        for req in waiting.values():
            state: GrammarState = req.structured_output
            try:
                if self._try_ready(req):
                    ready.append(req)
                    continue
            except ValueError as e:
                failed.append((req, str(e)))
                continue
            started = state.compile.started
            # Timed from the compile's start; a compile still queued behind others fails
            # after 3 timeouts, but never while the tokenizer itself is still loading.
            queued_too_long = (not started and self._backend is not None
                               and now - state.submitted > 3 * timeout)
            if (started and now - started > timeout) or queued_too_long:
                failed.append((req, (
                    f"structured_outputs: the grammar did not compile within {timeout:g} s "
                    "(--structured-outputs-compile-timeout); simplify the schema or grammar")))
        return ready, failed

    def wait(self, waiting: dict[str, Any], timeout_s: float) -> None:
        """Block until one of the compiles ``waiting`` requests need finishes, or timeout."""
        futures = {r.structured_output.compile.future for r in waiting.values()}
        if futures:
            cf.wait(futures, timeout=timeout_s, return_when=cf.FIRST_COMPLETED)

    # ------------------------------------------------------------------ each step
    def grammar_bitmask(self, reqs: list[Any]) -> tuple[dict[str, int], np.ndarray]:
        """One bitmask row per request that samples this step (1 bits: allowed tokens)."""
        backend = self.backend
        bitmask = backend.allocate_bitmask(len(reqs))
        rows: dict[str, int] = {}
        for i, req in enumerate(reqs):
            rows[req.request_id] = i
            matcher = req.structured_output.matcher
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, i)
        return rows, bitmask

    def accept_token(self, req: Any, token_id: int) -> bool:
        """Advance ``req``'s matcher by one sampled token; True if the grammar terminated."""
        matcher = req.structured_output.matcher
        if matcher.is_terminated():
            return True
        if not matcher.accept_token(token_id):
            # Only when something bypassed the mask (e.g. min_tokens masked every token the
            # grammar allowed): the output is no longer valid, so stop here.
            logger.warning("request %s: token %d is not allowed by its grammar; stopping it",
                           req.request_id, token_id)
            return True
        return matcher.is_terminated()

    def jump_forward_tokens(self, req: Any) -> list[int]:
        """Tokens the grammar forces next (accepted into the matcher), or [] if none or off."""
        if not self.config.jump_forward or req.sampling_params.logprobs is not None:
            return []
        state: GrammarState = req.structured_output
        matcher = state.matcher
        tokens = list(matcher.find_jump_forward_tokens())
        for i, t in enumerate(tokens):
            if not matcher.accept_token(t):  # cannot happen for forced tokens; be safe
                tokens = tokens[:i]
                break
        state.num_forced_tokens += len(tokens)
        self.num_forced_tokens += len(tokens)
        return tokens

    def rollback(self, req: Any, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (jump-forward tokens cut by a stop)."""
        if num_tokens:
            req.structured_output.matcher.rollback(num_tokens)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_xgrammar_manager(config: StructuredOutputsConfig, tokenizer_path: Any, vocab_size: int,
                          stop_token_ids: list[int]) -> StructuredOutputManager:
    """The engine's manager: the tokenizer is loaded and the xgrammar tokenizer info built in a
    compile worker, on the first constrained request, never on the busy loop."""

    def factory() -> Any:
        from pathlib import Path

        from llmtower.models.loader import load_tokenizer, resolve_model_path
        from llmtower.structured_output.backend_xgrammar import XgrammarBackend

        path = Path(tokenizer_path).expanduser()
        tokenizer = load_tokenizer(path if path.is_dir() else resolve_model_path(tokenizer_path))
        stops = list(stop_token_ids)
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None and eos not in stops:
            stops.append(eos)
        return XgrammarBackend(tokenizer, vocab_size, stops, config.any_whitespace)

    return StructuredOutputManager(config, factory)
