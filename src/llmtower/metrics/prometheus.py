"""Prometheus metrics of one served model, under vLLM's names so existing dashboards work.

Two sources feed them: the engines' ``SchedulerStats`` snapshots (queue lengths, KV-cache
usage, cumulative counters, per-step tokens and seconds), and the API process's own view of
each request (tokens as they stream, inter-token gaps, and the engine's ``RequestMetrics``
when it finishes). Each server gets its own ``CollectorRegistry``, so two servers (or tests)
in one process never share counters.

Every engine series carries ``model_name`` and ``engine`` (the data-parallel engine index, as
in vLLM): ``EngineSeries`` holds one engine's labelled children. A new series is one row in
``ENGINE_METRICS`` plus the line that records it (``record_*`` below); the families of other
features (spec decode, ...) go in the same table. The registry also holds the process
(``process_*``), Python (``python_*``) and HTTP (``http_*``, see ``metrics/http.py``)
families that vLLM's dashboards read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from llmtower.metrics.lora_info import LoRAInfoGauge
from llmtower.core.outputs import RequestMetrics, SchedulerStats
from llmtower.metrics import buckets
from llmtower.metrics.histogram_batch import observe_repeated
from llmtower.metrics.http import HTTPMetrics
from llmtower.metrics.sliding_quantile import SlidingWindowQuantile

# The *_created companion series double the output and no dashboard reads them.
prometheus_client.disable_created_metrics()

# Finish reasons exported from the start at 0, so rate() and dashboards see every one.
FINISH_REASONS = ("stop", "length", "abort")
FRAGMENTATION_KINDS = ("internal", "external")
# Why a request can be refused before it runs (engine RequestError kinds, and the API's timeout).
REJECTION_REASONS = ("admission", "queue_full", "invalid", "timeout")
QUEUE_TIME_P99_WINDOW_S = 60.0


@dataclass(frozen=True)
class MetricSpec:
    """One engine-labelled family: the ``EngineSeries`` attribute, its kind, exposed name,
    help text, buckets (histograms) and labels beyond ``model_name`` and ``engine``."""

    attr: str
    kind: str  # "gauge" | "counter" | "histogram"
    name: str
    doc: str
    buckets: tuple[float, ...] = ()
    labels: tuple[str, ...] = ()


def _g(attr: str, name: str, doc: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(attr, "gauge", name, doc, labels=labels)


def _c(attr: str, name: str, doc: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(attr, "counter", name, doc, labels=labels)


def _h(attr: str, name: str, doc: str, bucket_list: list) -> MetricSpec:
    return MetricSpec(attr, "histogram", name, doc, buckets=tuple(bucket_list))


ENGINE_METRICS: tuple[MetricSpec, ...] = (
    # --- scheduler state (gauges, from the engine's snapshots) -------------------------
    _g("num_requests_running", "vllm:num_requests_running",
       "Requests holding KV blocks and being stepped."),
    _g("num_requests_waiting", "vllm:num_requests_waiting",
       "Requests admitted but waiting to run (the scheduler's queue depth)."),
    _g("num_requests_swapped", "vllm:num_requests_swapped",
       "Requests preempted by swap to CPU memory."),
    _g("input_queue_size", "llmtower:input_queue_size",
       "Requests received by the engine process but not yet taken in by the scheduler."),
    _g("batch_utilization", "llmtower:batch_utilization",
       "Scheduled tokens / token budget, mean over recent steps."),
    _g("queue_time_p99", "llmtower:request_queue_time_p99_seconds",
       "p99 of the queue time of requests finished in the last 60 s."),
    # --- KV cache -----------------------------------------------------------------------
    _g("kv_cache_usage", "vllm:kv_cache_usage_perc",
       "KV-cache usage as a fraction (1 = every block in use)."),
    _g("kv_cache_free_blocks", "llmtower:kv_cache_free_blocks",
       "Free KV blocks (including free blocks that still hold a cached prefix)."),
    _g("fragmentation", "llmtower:kv_cache_fragmentation_ratio",
       "internal: allocated KV slots holding no token / allocated slots; "
       "external: 1 - largest free run / free blocks.", ("kind",)),
    _g("prefix_cache_blocks", "llmtower:prefix_cache_blocks",
       "KV blocks registered in the prefix cache (in use or free)."),
    _c("prefix_cache_queries", "vllm:prefix_cache_queries",
       "Prompt tokens looked up in the prefix cache."),
    _c("prefix_cache_hits", "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    _c("prefix_cache_evictions", "llmtower:prefix_cache_evictions",
       "Cached blocks evicted (reused for other content)."),
    _c("num_preemptions", "vllm:num_preemptions", "Requests preempted (recompute or swap)."),
    # --- memory under pressure (docs/memory.md) -------------------------------------------
    _g("degradation_level", "llmtower:degradation_level",
       "Graceful degradation: 0 normal, 1 evict, 2 compress, 3 shrink the batch, 4 refuse."),
    _c("degradation_actions", "llmtower:degradation_actions",
       "Degradation actions taken, by action (evict: prefix blocks evicted under pressure; "
       "shrink / grow: 10% steps of the batch limits; refuse: requests shed with 429).",
       ("action",)),
    _c("block_moves", "llmtower:kv_block_moves", "KV blocks moved by the relocator."),
    # --- --policy fair: per tenant (the first MAX_TENANT_SERIES tenants of each engine) ---
    _c("tenant_tokens", "llmtower:tenant_tokens_served",
       "Prefill and decode tokens scheduled for a tenant (--policy fair).", ("tenant",)),
    _c("tenant_admitted", "llmtower:tenant_requests_admitted",
       "Requests of a tenant admitted for the first time (--policy fair).", ("tenant",)),
    _c("tenant_queue_time", "llmtower:tenant_queue_time_seconds",
       "Summed queue time (queued to first scheduled) of a tenant's admitted requests.",
       ("tenant",)),
    _g("pinned_blocks", "llmtower:kv_cache_pinned_blocks",
       "KV blocks pinned by preloaded prefixes (kept out of eviction)."),
    _c("swap_outs", "llmtower:swap_outs", "Requests swapped out to CPU memory."),
    _c("swap_ins", "llmtower:swap_ins", "Requests swapped back in from CPU memory."),
    # --- speculative decoding (docs/spec_decode.md) ----------------------------------------
    _c("spec_decode_num_drafts", "vllm:spec_decode_num_drafts",
       "Verifications of one request's draft tokens (one per request per step with drafts)."),
    _c("spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens",
       "Draft tokens verified."),
    _c("spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
       "Draft tokens accepted."),
    _c("spec_decode_num_accepted_tokens_per_pos", "vllm:spec_decode_num_accepted_tokens_per_pos",
       "Draft tokens accepted, by position in the draft (0: the first).", ("position",)),
    # --- per step -------------------------------------------------------------------------
    _h("iteration_tokens", "vllm:iteration_tokens_total", "Tokens scheduled in one engine step.",
       buckets.ITERATION_TOKENS),
    _h("step_seconds", "llmtower:scheduler_step_seconds",
       "Wall time of one engine step (schedule, execute, update).", buckets.STEP_SECONDS),
    _h("step_delay", "llmtower:scheduler_step_delay_seconds",
       "The scheduling decision alone (schedule()) of one engine step.",
       buckets.STEP_DELAY_SECONDS),
    # --- tokens and requests (the API process's view) ---------------------------------
    _c("prompt_tokens", "vllm:prompt_tokens", "Prefilled prompt tokens."),
    _c("prompt_tokens_cached", "vllm:prompt_tokens_cached",
       "Prompt tokens of finished requests served from the prefix cache."),
    _c("generation_tokens", "vllm:generation_tokens", "Generated tokens."),
    _c("request_success", "vllm:request_success", "Finished requests, by finish reason.",
       ("finished_reason",)),
    _h("ttft", "vllm:time_to_first_token_seconds", "Time to first token.", buckets.TTFT),
    _h("itl", "vllm:inter_token_latency_seconds", "Time between two outputs of a request.",
       buckets.ITL),
    _h("tpot", "vllm:request_time_per_output_token_seconds",
       "Decode time / (generated tokens - 1) of a finished request.", buckets.ITL),
    _h("e2e", "vllm:e2e_request_latency_seconds", "Arrival to finish of a request.",
       buckets.REQUEST_TIME),
    _h("queue_time", "vllm:request_queue_time_seconds",
       "Time a request waited before it was first scheduled.", buckets.REQUEST_TIME),
    _h("inference_time", "vllm:request_inference_time_seconds",
       "First scheduled to finished (prefill + decode).", buckets.REQUEST_TIME),
    _h("prefill_time", "vllm:request_prefill_time_seconds", "First scheduled to first token.",
       buckets.REQUEST_TIME),
    _h("decode_time", "vllm:request_decode_time_seconds", "First token to last token.",
       buckets.REQUEST_TIME),
    _h("request_prompt_tokens", "vllm:request_prompt_tokens",
       "Prompt tokens of a finished request.", buckets.REQUEST_TOKENS),
    _h("request_generation_tokens", "vllm:request_generation_tokens",
       "Generated tokens of a finished request (all its samples).", buckets.REQUEST_TOKENS),
    _h("request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens",
       "Generated tokens of the longest sample of a finished request.",
       buckets.REQUEST_TOKENS),
    _h("request_prefill_kv_computed_tokens", "vllm:request_prefill_kv_computed_tokens",
       "Prompt tokens whose KV was computed (not found in the prefix cache).",
       buckets.REQUEST_TOKENS),
    _h("request_params_n", "vllm:request_params_n", "The n parameter of a finished request.",
       buckets.PARAMS_N),
    _h("request_params_max_tokens", "vllm:request_params_max_tokens",
       "The max_tokens parameter of a finished request (the room left when not given).",
       buckets.REQUEST_TOKENS),
    _h("request_num_preemptions", "vllm:request_num_preemptions",
       "Times a finished request was preempted.", buckets.NUM_PREEMPTIONS),
)


@dataclass
class RequestParams:
    """What the API process knew of a request when it was sent (for the params histograms)."""

    n: int = 1
    max_tokens: int | None = None
    max_num_generation_tokens: int | None = None  # of its longest sample


class EngineSeries:
    """Owns one engine's labelled children of every ``ENGINE_METRICS`` family, the cumulative
    totals of its last snapshot (Prometheus counters take increments) and its queue-time
    window."""

    def __init__(self, families: dict[str, Any], model_name: str, engine: int) -> None:
        self.engine = engine
        labels = (model_name, str(engine))
        for spec in ENGINE_METRICS:
            family = families[spec.attr]
            if spec.labels:  # the caller adds the extra label values
                setattr(self, spec.attr, _Partial(family, labels))
            else:
                setattr(self, spec.attr, family.labels(*labels))
        for reason in FINISH_REASONS:
            self.request_success(reason)
        for kind in FRAGMENTATION_KINDS:
            self.fragmentation(kind)
        self.queue_time_window = SlidingWindowQuantile(0.99, QUEUE_TIME_P99_WINDOW_S)
        self.queue_time_p99.set_function(self.queue_time_window.value)
        self.last_totals: dict[str, float] = {}
        self.last_stats: SchedulerStats | None = None


    def __getattr__(self, name: str) -> Any:
        # Only reached for a name ENGINE_METRICS does not define (the children are set in
        # __init__); it also tells type checkers that those attributes exist.
        raise AttributeError(f"no engine series {name!r}: add a row to ENGINE_METRICS")


class _Partial:
    """A family with its first label values bound: ``partial(reason)`` is the child."""

    def __init__(self, family: Any, labels: tuple[str, ...]) -> None:
        self.family = family
        self.labels = labels

    def __call__(self, *more: str) -> Any:
        return self.family.labels(*self.labels, *more)


# Tenant names come from clients (X-Tenant / user): at most this many label values per engine.
MAX_TENANT_SERIES = 100

# Engine snapshot totals (cumulative) -> the counter they feed.
_COUNTER_TOTALS = (("prefix_cache_queries", "prefix_cache_queries"),
                   ("prefix_cache_hits", "prefix_cache_hits"),
                   ("num_evictions", "prefix_cache_evictions"),
                   ("num_preemptions_total", "num_preemptions"),
                   ("num_swap_outs_total", "swap_outs"),
                   ("num_swap_ins_total", "swap_ins"),
                   ("num_block_moves_total", "block_moves"),
                   ("spec_num_drafts", "spec_decode_num_drafts"),
                   ("spec_num_draft_tokens", "spec_decode_num_draft_tokens"),
                   ("spec_num_accepted_tokens", "spec_decode_num_accepted_tokens"))


class ServingMetrics:
    """Owns the Prometheus registry of one served model (engine families, ``cache_config_info``,
    admission rejections, process and HTTP families) and one ``EngineSeries`` per engine;
    turns engine snapshots and finished requests into metric updates."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 num_engines: int = 1) -> None:
        self.model_name = model_name
        self.registry = reg = registry or CollectorRegistry()
        base = ["model_name", "engine"]
        kinds = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}
        self._families: dict[str, Any] = {}
        for spec in ENGINE_METRICS:
            kwargs: dict[str, Any] = {"buckets": list(spec.buckets)} if spec.buckets else {}
            self._families[spec.attr] = kinds[spec.kind](
                spec.name, spec.doc, base + list(spec.labels), registry=reg, **kwargs)
        self.admission_rejections = Counter(
            "vllm:admission_rejections", "Requests refused before they ran, by reason.",
            ["model_name", "reason"], registry=reg)
        for reason in REJECTION_REASONS:
            self.admission_rejections.labels(model_name, reason)
        self._cache_config_info: Gauge | None = None
        self.engines: list[EngineSeries] = []
        for i in range(num_engines):
            self.engine(i)
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        self.http = HTTPMetrics(reg)
        self.lora_info = LoRAInfoGauge(reg)  # vllm:lora_requests_info (--enable-lora)

    def engine(self, index: int = 0) -> EngineSeries:
        """The series of engine ``index`` (created, at zero, on first use)."""
        while len(self.engines) <= index:
            self.engines.append(EngineSeries(self._families, self.model_name, len(self.engines)))
        return self.engines[index]

    @property
    def last_stats(self) -> SchedulerStats | None:
        """The latest snapshot of engine 0."""
        return self.engines[0].last_stats if self.engines else None

    # ------------------------------------------------------------------ configuration
    def record_cache_config(self, config: dict[str, Any]) -> None:
        """``vllm:cache_config_info``: the KV-cache settings as labels of a gauge at 1, one
        per engine (vLLM's info-gauge convention)."""
        names = sorted(config)
        if self._cache_config_info is None:
            self._cache_config_info = Gauge("vllm:cache_config_info",
                                            "Information of the KV cache configuration.",
                                            ["model_name", "engine", *names],
                                            registry=self.registry)
        for e in self.engines:
            self._cache_config_info.labels(self.model_name, str(e.engine),
                                           *(str(config[n]) for n in names)).set(1)

    # ------------------------------------------------------------------ engine snapshots
    def record_scheduler_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        e = self.engine(engine)
        e.last_stats = stats
        e.num_requests_running.set(stats.num_running_reqs)
        e.num_requests_waiting.set(stats.num_waiting_reqs)
        e.num_requests_swapped.set(stats.num_swapped_reqs)
        e.input_queue_size.set(stats.input_queue_size)
        e.kv_cache_usage.set(stats.kv_cache_usage)
        e.kv_cache_free_blocks.set(stats.num_free_blocks)
        e.fragmentation("internal").set(stats.fragmentation)
        e.fragmentation("external").set(stats.external_fragmentation)
        e.prefix_cache_blocks.set(stats.num_cached_blocks)
        e.degradation_level.set(stats.degradation_level)
        e.pinned_blocks.set(stats.num_pinned_blocks)
        self.lora_info.record(stats, engine)
        for action, new in stats.degradation_actions.items():
            old = e.last_totals.get(f"degradation_{action}", 0)
            if new > old:
                e.degradation_actions(action).inc(new - old)
            e.last_totals[f"degradation_{action}"] = new
        for tenant, t in list(stats.tenants.items())[:MAX_TENANT_SERIES]:
            for key, attr in (("tokens_served", "tenant_tokens"), ("num_admitted",
                              "tenant_admitted"), ("queue_time_sum", "tenant_queue_time")):
                old = e.last_totals.get(f"tenant_{key}_{tenant}", 0)
                if t[key] > old:
                    getattr(e, attr)(tenant).inc(t[key] - old)
                e.last_totals[f"tenant_{key}_{tenant}"] = t[key]
        for field, attr in _COUNTER_TOTALS:
            new = getattr(stats, field)
            old = e.last_totals.get(field, 0)
            if new > old:
                getattr(e, attr).inc(new - old)
            e.last_totals[field] = new
        for pos, new in enumerate(stats.spec_num_accepted_tokens_per_pos):
            old = e.last_totals.get(f"spec_pos_{pos}", 0)
            child = e.spec_decode_num_accepted_tokens_per_pos(str(pos))  # exported from 0
            if new > old:
                child.inc(new - old)
            e.last_totals[f"spec_pos_{pos}"] = new
        for n in stats.step_num_tokens:
            e.iteration_tokens.observe(n)
        for s in stats.step_seconds:
            e.step_seconds.observe(s)
        for s in stats.step_schedule_seconds:
            e.step_delay.observe(s)
        if stats.token_budget:
            steps = stats.step_num_tokens or [stats.last_step_num_tokens]
            e.batch_utilization.set(sum(steps) / len(steps) / stats.token_budget)

    # ------------------------------------------------------------------ requests
    def record_prompt_tokens(self, n: int, engine: int = 0) -> None:
        self.engine(engine).prompt_tokens.inc(n)

    def record_generation_tokens(self, n: int, engine: int = 0) -> None:
        self.engine(engine).generation_tokens.inc(n)

    def record_inter_token_latencies(self, counts: list[tuple[float, int]], engine: int = 0
                                     ) -> None:
        """Each ``(seconds, how many streams had that latency)`` of one step."""
        itl = self.engine(engine).itl
        for seconds, count in counts:
            observe_repeated(itl, seconds, count)

    def record_finished(self, finish_reason: str, engine: int = 0) -> None:
        """One sample (sequence) ended: ``stop``, ``length`` or ``abort``."""
        self.engine(engine).request_success(finish_reason).inc()

    def record_request_timings(self, metrics: RequestMetrics, engine: int = 0,
                               params: RequestParams | None = None) -> None:
        """Where one finished request spent its time and its sizes (once per request,
        whatever its n)."""
        e = self.engine(engine)
        if metrics.ttft:
            e.ttft.observe(metrics.ttft)
        e.e2e.observe(metrics.e2e_latency)
        e.queue_time.observe(metrics.queue_time)
        e.queue_time_window.observe(metrics.queue_time)
        e.prefill_time.observe(metrics.prefill_time)
        e.decode_time.observe(metrics.decode_time)
        e.inference_time.observe(metrics.prefill_time + metrics.decode_time)
        params = params or RequestParams()
        gen = metrics.num_generation_tokens
        longest = params.max_num_generation_tokens
        if longest is None:
            longest = gen if params.n == 1 else -(-gen // max(1, params.n))
        if longest > 1:
            e.tpot.observe(metrics.decode_time / (longest - 1))
        e.request_prompt_tokens.observe(metrics.num_prompt_tokens)
        e.request_generation_tokens.observe(gen)
        e.request_max_num_generation_tokens.observe(longest)
        e.request_prefill_kv_computed_tokens.observe(
            max(0, metrics.num_prompt_tokens - metrics.num_cached_tokens))
        e.prompt_tokens_cached.inc(metrics.num_cached_tokens)
        e.request_num_preemptions.observe(metrics.num_preemptions)
        e.request_params_n.observe(params.n)
        e.request_params_max_tokens.observe(
            params.max_tokens if params.max_tokens is not None else gen)

    def record_rejection(self, reason: str) -> None:
        self.admission_rejections.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return prometheus_client.generate_latest(self.registry)
