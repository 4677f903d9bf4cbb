"""Scheduler configuration: one frozen dataclass, validated once, documented per field, and
the rules that pair it with what the executor reported (`validate_against_executor`).

Every field with a `help` is also a flag (`--max-num-seqs`) and an environment variable
(`CHUNKSERVE_MAX_NUM_SEQS`), see chunkserve_contracts/flags.py. The names follow vLLM's where the
meaning matches.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler_svc.spec.config import parse_speculative_config

if TYPE_CHECKING:
    from chunkserve_contracts.executor.v1.executor_pb2 import HandshakeResponse

AUTO_MAX_BATCHED_TOKENS = 8192  # the upper bound `--max-num-batched-tokens auto` stands for (budget.py)
# --num-scheduler-steps: a plan of more steps would hold a new request back longer than any
# saving on the hop is worth.
MAX_SCHEDULER_STEPS = 64
AUTO_SCHEDULER_STEPS = 8  # --num-scheduler-steps unset, with a CPU executor (auto_scheduler_steps)


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler admits and how much work one step may carry."""

    max_num_batched_tokens: int = field(
        default=2048,
        metadata={
            "help": "token budget of one step: decode tokens plus prefill chunks; with --target-itl-ms the "
            "upper bound of the auto budget; auto = the executor's limit (`chunkserve serve` gives its "
            f"executor {AUTO_MAX_BATCHED_TOKENS}), with --target-itl-ms",
            "names": {"auto": 0},
        },
    )
    target_itl_ms: float | None = field(
        default=None,
        metadata={
            "help": "auto token budget: before each step, the largest budget whose predicted time (a "
            "step-time model fitted on this server's own steps) fits this many ms, what a decoding "
            "stream waits between tokens; --max-num-batched-tokens is then the upper bound (docs/tuning.md)"
        },
    )
    max_num_seqs: int = field(default=128, metadata={"help": "most sequences in one step"})
    max_model_len: int | None = field(
        default=None,
        metadata={
            "help": "most prompt + generated tokens per request (default: the model's context, "
            "capped by what the KV pool holds)"
        },
    )
    enable_chunked_prefill: bool = field(
        default=True,
        metadata={
            "help": "split long prefills into chunks mixed with decodes; off = whole-prompt prefill "
            "steps without decodes (prompts longer than the budget are refused)"
        },
    )
    max_num_partial_prefills: int = field(
        default=4, metadata={"help": "most requests in the middle of a chunked prefill at once"}
    )
    max_long_partial_prefills: int = field(
        default=1,
        metadata={
            "help": "most of those whose remaining prompt is longer than --long-prefill-token-threshold; "
            "a long prompt over this cap waits and shorter ones behind it start"
        },
    )
    long_prefill_token_threshold: int = field(
        default=0, metadata={"help": "a prefill with more tokens left than this is long (0 = 4%% of max_model_len)"}
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse the KV blocks of identical prompt prefixes across requests"}
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata={
            "help": "waiting order and preemption victims: fcfs, priority, sjf, fair, or a dotted path "
            "to your own class (docs/policies.md)"
        },
    )
    preemption_mode: str = field(
        default="recompute",
        metadata={
            "help": "when KV blocks run out: recompute (free the victim's blocks, prefill again later) "
            "or swap (copy them to host memory and back; falls back to recompute when full)",
            "choices": ("recompute", "swap"),
        },
    )
    max_preemptions: int = field(
        default=8,
        metadata={
            "help": "a request preempted this many times is never chosen as a victim again while another "
            "can be (forward progress)"
        },
    )
    max_waiting_requests: int = field(
        default=1024, metadata={"help": "requests allowed to wait for admission; more get RESOURCE_EXHAUSTED"}
    )
    host: str = field(default="0.0.0.0", metadata={"help": "address the public gRPC API listens on"})
    port: int = field(default=50051, metadata={"help": "port of the public gRPC API"})
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata={
            "secret": True,
            "help": "require `authorization: Bearer <key>` metadata on the public API (health and "
            "reflection stay open); set it through the environment, not the command line",
        },
    )
    tls_cert_file: str | None = field(
        default=None, metadata={"help": "PEM certificate chain: serve the public API over TLS (with --tls-key-file)"}
    )
    tls_key_file: str | None = field(default=None, metadata={"help": "PEM private key for --tls-cert-file"})
    http_host: str = field(default="0.0.0.0", metadata={"help": "address the OpenAI-compatible HTTP API listens on"})
    http_port: int = field(
        default=8000,
        metadata={
            "help": "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
            "/v1/models, /tokenize, /detokenize, /health, /version), beside the gRPC one; 0 = off"
        },
    )
    allowed_origins: str = field(
        default="",
        metadata={
            "help": "CORS on the HTTP API: origins allowed, comma-separated or a JSON list, * for any (vLLM's "
            "flag; vLLM defaults to *); empty = no CORS headers, browsers on other origins cannot read answers"
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={"help": "chat template replacing the model's: a file, or the Jinja text itself (as vLLM)"},
    )
    trust_request_chat_template: bool = field(
        default=False,
        metadata={"help": "run a `chat_template` sent in a request (vLLM's flag); off: such a request gets 400"},
    )
    openai_unknown_fields: str = field(
        default="reject",
        metadata={
            "help": "an HTTP request field chunkserve does not know: reject = 400 naming it; warn = accepted and "
            "logged once per name (vLLM's behaviour)",
            "choices": ("reject", "warn"),
        },
    )
    generation_config: str = field(
        default="auto",
        metadata={
            "help": "HTTP sampling defaults: auto = the model's generation_config.json (temperature, top_p, top_k, "
            "min_p, repetition_penalty, max_new_tokens), vllm = none, or a folder with a generation_config.json (as vLLM)"
        },
    )
    disable_uvicorn_access_log: bool = field(
        default=False, metadata={"help": "no access log line (client, method, path, status, ms) per HTTP request"}
    )
    disable_log_stats: bool = field(
        default=False,
        metadata={"help": "no stats line every 10 s (throughput, running/waiting requests, KV usage, prefix hit rate)"},
    )
    metrics_host: str = field(default="0.0.0.0", metadata={"help": "address of the Prometheus /metrics HTTP server"})
    metrics_port: int = field(default=9400, metadata={"help": "port of the Prometheus /metrics server; 0 = off"})
    admin_host: str = field(
        default="127.0.0.1",
        metadata={"help": "address of the Admin gRPC service (operators only: keep it on loopback)"},
    )
    admin_port: int = field(
        default=50052,
        metadata={
            "help": "port of the Admin gRPC service (`chunkserve admin`; on loopback unless --admin-host says "
            "otherwise); 0 = off"
        },
    )
    step_trace_file: str | None = field(
        default=None, metadata={"help": "append every step's plan summary to this file as JSON lines"}
    )
    kv_events_config: str | None = field(
        default=None,
        metadata={
            "help": "publish KV cache events in vLLM's format (ZMQ PUB of msgpack batches) for llm-d, Dynamo and "
            "vllm-router: vLLM's --kv-events-config JSON (enable_kv_cache_events, publisher, endpoint, "
            "replay_endpoint, buffer_steps, hwm, max_queue_size, topic); needs pyzmq and msgspec, the kv-events "
            "extra (docs/deploy.md)"
        },
    )
    executor_address: str = field(default="127.0.0.1:50061", metadata={"help": "host:port of the executor service"})
    executor_token: str | None = field(
        default=None,
        repr=False,
        metadata={
            "secret": True,
            "help": (
                "the executor's shared secret, sent as `authorization: Bearer <token>` on every executor "
                "call; must equal the executor's. Set CHUNKSERVE_EXECUTOR_TOKEN, not the flag"
            ),
        },
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "folder with tokenizer.json (default: the model folder the executor reports)"}
    )
    served_model_name: str | None = field(
        default=None,
        metadata={
            "help": "the model's name to clients and dashboards: the OpenAI API's `model`, GetInfo's model_name "
            "and the metrics' model_name label (default: the executor's --model)"
        },
    )
    startup_timeout_s: float = field(
        default=600.0, metadata={"help": "how long to wait for the executor's handshake at start-up"}
    )
    async_output_processing: bool = field(
        default=False,
        metadata={
            "help": "stream a step's tokens and update metrics/trace after the next step is sent, while the "
            "executor computes it (vLLM's async output processing): less executor idle time between steps; a "
            "stop string then ends its request one step late (that extra token is computed and dropped)"
        },
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata={
            "help": "plan step N+1 and send it while the executor computes step N (vLLM's --async-scheduling, "
            "SGLang's overlap scheduler): a decode of the token step N samples is planned before its id is "
            "known, and the executor feeds it back; the executor then waits for no plan between steps. Output "
            "is served while the next step runs (as with --async-output-processing); a request ended by EOS or "
            "a stop string computes one token more, which is dropped. Greedy tokens are the same either way. "
            "Unset: on with a GPU executor; with a CPU one only while a step holds at most 2 sequences, where "
            "the scheduler's work beside the executor's threads costs less than the hop it hides; off with "
            "speculative decoding or --async-output-processing"
        },
    )
    speculative_config: str | None = field(
        default=None,
        metadata={
            "help": "speculative decoding without a draft model, as vLLM spells it: JSON such as "
            '{"method": "ngram", "num_speculative_tokens": 4} or {"method": "suffix"}; drafts come from the '
            "request's own text (and, for suffix, recent outputs), the executor verifies them, and a gate "
            "drafts only while this machine's measured step times say it pays; greedy output is unchanged "
            "(docs/speculative.md)"
        },
    )
    num_scheduler_steps: int | None = field(
        default=None,
        metadata={
            "help": "multi-step decoding (vLLM's flag): a step of decodes alone, with no request waiting, runs up "
            "to this many decode steps in the executor from one plan, so the scheduling and the plan's hop are "
            "paid once for that many tokens; each step's tokens still stream as it ends "
            "(--multi-step-stream-outputs), and a request that arrives cuts the plan short after the step under "
            f"way; 1..{MAX_SCHEDULER_STEPS}; greedy output unchanged (docs/architecture.md). Unset: "
            f"{AUTO_SCHEDULER_STEPS} with a CPU executor of one process, 1 with a GPU, tensor parallelism, "
            "speculative decoding or --no-multi-step-stream-outputs (auto_scheduler_steps)"
        },
    )
    multi_step_stream_outputs: bool = field(
        default=True,
        metadata={
            "help": "with --num-scheduler-steps, stream each token as its step ends (vLLM's flag of this name): "
            "the executor answers every step of a multi-step plan, so only the plan and the scheduling are paid "
            "once for k tokens, and a plan whose requests all ended is cut; off: a plan's tokens arrive together"
        },
    )
    step_timeout_s: float = field(
        default=120.0, metadata={"help": "a step the executor has not answered after this long fails its requests"}
    )

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens == 0 and self.target_itl_ms is None:  # 0 = `auto`
            raise ValueError("--max-num-batched-tokens auto needs --target-itl-ms (the step-time target)")
        if self.target_itl_ms is not None:
            if not (self.target_itl_ms > 0 and math.isfinite(self.target_itl_ms)):
                raise ValueError(f"--target-itl-ms must be a positive number of ms, got {self.target_itl_ms}")
            if not self.enable_chunked_prefill:
                raise ValueError("--target-itl-ms needs chunked prefill (a whole prompt cannot be cut to a target)")
        least = dict(
            max_num_batched_tokens=0,  # 0 = auto: the executor's limit (resolve_auto)
            max_num_seqs=1,
            max_model_len=2,
            max_num_partial_prefills=1,
            long_prefill_token_threshold=0,
            max_preemptions=1,
            max_waiting_requests=1,
            num_scheduler_steps=1,
        )
        for name, low in least.items():
            if (value := getattr(self, name)) is not None and value < low:  # max_model_len None = decided
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError(
                f"--max-long-partial-prefills must be in [1, --max-num-partial-prefills], "
                f"got {self.max_long_partial_prefills}"
            )
        if (self.num_scheduler_steps or 1) > MAX_SCHEDULER_STEPS:
            raise ValueError(f"--num-scheduler-steps must be <= {MAX_SCHEDULER_STEPS}, got {self.num_scheduler_steps}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        parse_speculative_config(self.speculative_config)  # ValueError naming what it would not honour
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"--preemption-mode must be recompute or swap, got {self.preemption_mode!r}")


def resolve_auto(config: SchedulerConfig, hs: HandshakeResponse) -> SchedulerConfig:
    """What waits for the executor's handshake: `--max-num-batched-tokens auto` (0) becomes the
    executor's limit, an unset `--num-scheduler-steps` `auto_scheduler_steps`."""
    if config.max_num_batched_tokens == 0:
        config = dataclasses.replace(config, max_num_batched_tokens=hs.max_num_batched_tokens)
    if config.num_scheduler_steps is None:
        config = dataclasses.replace(config, num_scheduler_steps=auto_scheduler_steps(config, hs))
    return config


def auto_scheduler_steps(config: SchedulerConfig, hs: HandshakeResponse) -> int:
    """Multi-step plans by default where they were measured to pay: a CPU executor of one
    process, whose batch-1 token through the server they made 1-3% shorter in batch1_floor.py's
    rounds and 6-11% more tok/s in multi_step.py's (the scheduling and the plan's message paid
    once for 8 tokens, on the cores the step's threads fill), arrivals
    served sooner and 32 streams no slower, each step's tokens still streamed as it ends
    (benchmarks/RESULTS.md, "Multi-step plans that stream each step"). Not on a GPU (not
    measured there), not under tensor parallelism (its plans run whole: an arrival would wait
    for all the steps), not with speculative decoding (a plan that drafts is never extended,
    and one that is extended drafts for none of its steps), not without streamed steps (a
    stream would get its tokens in bursts)."""
    if (
        hs.device != "cpu"
        or hs.tensor_parallel_size > 1
        or config.speculative_config
        or not config.multi_step_stream_outputs
    ):
        return 1
    return AUTO_SCHEDULER_STEPS


def validate_against_executor(config: SchedulerConfig, hs: HandshakeResponse, max_model_len: int | None = None) -> int:
    """The rules pairing these settings with the executor's handshake, for start-up (app.py) and
    every live change (admin.py) alike. Returns max_model_len: the one given (live: fixed at
    start-up), else the configured one, else the largest that works. ValueError says what to change."""
    if config.max_num_batched_tokens > hs.max_num_batched_tokens:
        raise ValueError(
            f"--max-num-batched-tokens {config.max_num_batched_tokens} is larger than the executor's "
            f"{hs.max_num_batched_tokens}, the most tokens it accepts in one step: lower it, or "
            "give the executor the same --max-num-batched-tokens"
        )
    if config.preemption_mode == "swap" and not hs.num_host_blocks:
        raise ValueError("--preemption-mode swap needs host swap blocks: give the executor --swap-space > 0")
    caps = [  # (what bounds max_model_len, its value, what to change)
        ("the model's context (max_position_embeddings)", hs.model.max_position_embeddings, "lower --max-model-len"),
        (
            f"the KV pool ({hs.num_device_blocks} blocks x {hs.block_size} tokens)",
            hs.num_device_blocks * hs.block_size,
            "lower --max-model-len or give the executor more KV memory",
        ),
    ]
    if not config.enable_chunked_prefill:
        caps.append(
            (
                "--max-num-batched-tokens with chunked prefill off (a prompt must fit one step)",
                config.max_num_batched_tokens,
                "raise --max-num-batched-tokens, keep chunked prefill on, or lower --max-model-len",
            )
        )
    wanted = max_model_len or config.max_model_len
    for what, cap, change in caps:
        if wanted is not None and wanted > cap:
            raise ValueError(f"max_model_len {wanted} exceeds {what} = {cap}: {change}")
    return wanted or min(cap for _, cap, _ in caps)


# Without --async-scheduling or --no-async-scheduling, a CPU executor's next step is planned
# while one of at most this many sequences runs. Overlap hides the hop between steps (~2 ms a
# token on a 2-core EPYC), but on a CPU the scheduler's own work then shares the cores with the
# executor's threads and lengthens its step: by less than the hop at 1 sequence, by more at 32
# (~6 ms of work a step there). benchmarks/RESULTS.md, "Async scheduling by default for small
# steps". A GPU leaves the host's cores to the scheduler: on an H200 every step overlapped gave
# 1.95x the tokens/s of the plain loop (32 streams of a tiny model, ~1 ms steps; benchmarks/GPU.md).
AUTO_OVERLAP_MAX_SEQS = 2


def overlap_limit(config: SchedulerConfig, device: str) -> int | None:
    """How many sequences a step in flight may hold for the next step to be planned on top of it
    (async scheduling): None for any number (--async-scheduling, and by default on a GPU), 0 for
    none (--no-async-scheduling; by default also with --async-output-processing, which the plain
    loop serves, or speculative decoding, whose drafts need a known last token), else
    AUTO_OVERLAP_MAX_SEQS. A bigger step is finished before the next is planned."""
    if config.async_scheduling is not None:
        return None if config.async_scheduling else 0
    if config.async_output_processing or config.speculative_config:
        return 0
    return None if device.startswith("cuda") else AUTO_OVERLAP_MAX_SEQS
