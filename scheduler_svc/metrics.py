"""Prometheus metrics with vLLM's names under the `chunkserve_` prefix, owned by the scheduler.

Dashboards built for vLLM carry over by replacing `vllm:` with `chunkserve_`: same names,
suffixes, buckets and `model_name` label. Two deliberate differences, because the output
must pass `promtool check metrics`: the prefix ends in `_`, not `:` (colons are reserved
for recording rules), and the tokens-per-step histogram is `iteration_tokens`, not
`iteration_tokens_total` (`_total` is for counters). `finished_reason` takes vLLM's values:
`stop` (EOS, a stop string or a stop token id), `length`, `abort` (aborted or failed). Every
series vLLM's Grafana dashboard reads is here; docs/grafana/chunkserve-dashboard.json is that
dashboard adapted. All intervals are measured on this process's monotonic clock (the executor
only reports its own step time), so no multiprocess registry is needed. Served over plain HTTP on
`--metrics-port` by prometheus_client's threaded server.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from scheduler_svc.observer import Observer, StepRecord
from scheduler_svc.request import FinishReason, Request
from scheduler_svc.slowdown import SlowdownWatch
from scheduler_svc.snapshot import SchedulerSnapshot
from scheduler_svc.spec.verify import accepted_counts

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's finished_reason values: a stop string or stop token id is `stop` like EOS.
FINISH_LABELS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.ABORTED: "abort",
}


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class Metrics(Observer):
    """Every metric the scheduler exports; `registry` is private to this instance."""

    def __init__(self, model_name: str, max_model_len: int = 8192) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"chunkserve_{name}", doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"chunkserve_{name}", doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"chunkserve_{name}", doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.running = gauge("num_requests_running", "Requests being computed (prefilling or decoding).")
        self.waiting = gauge(
            "num_requests_waiting",
            "Requests waiting for admission, recompute-preempted ones included; swapped ones are in "
            "num_requests_swapped.",
        )
        self.swapped = gauge("num_requests_swapped", "Requests whose KV is swapped out to host memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of device KV blocks in use, 0 to 1.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (counted at the first token).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Preemptions (a request losing its KV blocks).")
        self.swapped_out = counter("kv_blocks_swapped_out", "KV blocks copied device -> host by swap preemption.")
        self.swapped_in = counter("kv_blocks_swapped_in", "KV blocks copied host -> device on resume.")
        self.recomputed = counter("num_recomputed_tokens", "Computed tokens discarded by recompute preemption.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._success = Counter(
            "chunkserve_request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=reg,
        )
        self._model_name = model_name
        for label in dict.fromkeys(FINISH_LABELS.values()):
            self._success.labels(model_name, label)  # export zeros so rate() works from the start
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        # vLLM's older name for the same per-token observations, still read by its dashboard.
        self.tpot = histogram(
            "time_per_output_token_seconds", "Time between consecutive tokens (= inter_token_latency).", ITL_BUCKETS
        )
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds", "Per request: decode time / (generated tokens - 1).", ITL_BUCKETS
        )
        length_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens per finished request.", length_buckets)
        self.request_generation = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", length_buckets
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to finish.", REQUEST_BUCKETS)
        self.step_tokens = histogram("iteration_tokens", "Tokens computed per step.", STEP_TOKEN_BUCKETS)
        self.token_budget = gauge(
            "step_token_budget",
            "Token budget of the last step: --max-num-batched-tokens, or the auto budget's choice "
            "under --target-itl-ms.",
        )
        self.predicted_step = gauge(
            "auto_budget_predicted_step_seconds",
            "The auto budget's predicted time of the last step's budget (0 when fixed or not fitted yet).",
        )
        self.slowdown = SlowdownWatch()
        self.slowdown_ratio = gauge(
            "decode_step_slowdown_ratio",
            "Median executor time of recent decode steps of one shape over the best this server saw for that "
            "shape (1 = as fast as it was; 3+ sustained: CPU contention or a CPU quota, scheduler_svc/slowdown.py).",
        )
        self.slowdown_ratio.set(1.0)
        self.executor_threads = gauge(
            "executor_cpu_threads",
            "torch CPU threads the executor's last step ran with (it moves them by measured step times unless "
            "--num-threads fixed them; fewer than the CPUs it started with: other work takes cores, docs/cpu.md).",
        )
        self._spec_metrics(counter, labels)

    def _spec_metrics(self, counter: Callable[[str, str], Counter], labels: list[str]) -> None:
        """Speculative decoding (vLLM's names): a draft is one request's draft tokens in one step."""
        self.spec_drafts = counter("spec_decode_num_drafts", "Verify entries: a request's draft tokens in one step.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_pos = Counter(
            "chunkserve_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = the first).",
            labels + ["position"],
            registry=self.registry,
        )

    def serve(self, host: str, port: int) -> None:
        """Serves /metrics over HTTP in a background thread."""
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ValueError(
                f"cannot serve /metrics on {host}:{port}: {exc.strerror}; choose another "
                "--metrics-port, or 0 to turn it off"
            ) from None

    def on_step(self, record: StepRecord) -> None:
        plan, stats = record.plan, record.stats
        self.step_tokens.observe(plan.num_tokens)
        for _ in range(record.result.num_steps - 1):  # a multi-step plan's later steps: a decode per entry
            self.step_tokens.observe(len(plan.seqs))
        self.preemptions.inc(len(plan.preempted))
        self.swapped_out.inc(len(plan.swap_out))
        self.swapped_in.inc(len(plan.swap_in))
        self.recomputed.inc(stats.recomputed_tokens)
        self.token_budget.set(stats.token_budget)
        self.predicted_step.set(stats.predicted_step_ms / 1e3)
        self.prefix_queries.inc(stats.prefix_queries)
        self.prefix_hits.inc(stats.prefix_hits)
        # A steady clock for its "sustained for 30 s" (planned_at is wall time, which can jump).
        self.slowdown_ratio.set(self.slowdown.observe(plan, record.result, time.monotonic()))
        if record.result.num_threads:
            self.executor_threads.set(record.result.num_threads)
        for drafted, accepted in accepted_counts(plan, record.result).values():
            self.spec_drafts.inc()
            self.spec_draft_tokens.inc(drafted)
            self.spec_accepted.inc(accepted)
            for position in range(accepted):
                self._spec_per_pos.labels(self._model_name, str(position)).inc()
        self.on_state(record.state)

    def on_state(self, state: SchedulerSnapshot) -> None:
        self.running.set(state.num_running)
        self.waiting.set(state.num_waiting)
        self.swapped.set(state.num_swapped)
        self.kv_usage.set(state.kv_cache_usage)

    def clear_load(self) -> None:
        """Zeroes the load gauges when the engine is gone (executor lost, a new engine to come):
        they are otherwise only set after a step, and would show the dead engine's load until
        the next request."""
        for gauge in (self.running, self.waiting, self.swapped, self.kv_usage):
            gauge.set(0)

    def on_token(self, request: Request, now: float) -> None:
        self.generation_tokens.inc()
        if request.num_output_tokens == 1:
            self.prompt_tokens.inc(request.num_prompt_tokens)
            self.ttft.observe(now - request.arrival_time)
            if request.first_scheduled_time is not None:
                self.prefill.observe(now - request.first_scheduled_time)
        elif request.last_token_time is not None:
            self.itl.observe(now - request.last_token_time)
            self.tpot.observe(now - request.last_token_time)

    def on_finish(self, request: Request, reason: FinishReason, now: float) -> None:
        self._success.labels(self._model_name, FINISH_LABELS[reason]).inc()
        self.e2e.observe(now - request.arrival_time)
        if request.first_scheduled_time is not None:
            self.queue.observe(request.first_scheduled_time - request.arrival_time)
        if request.first_token_time is not None:
            self.decode.observe(now - request.first_token_time)
            if request.num_output_tokens > 1:
                self.request_tpot.observe((now - request.first_token_time) / (request.num_output_tokens - 1))
        self.request_prompt.observe(request.num_prompt_tokens)
        self.request_generation.observe(request.num_output_tokens)
