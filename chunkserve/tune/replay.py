"""The replay: the real Scheduler and BlockPool, a simulated clock, and a cost model as executor.

Requests enter the scheduler at their arrival times; each step is built by
`Scheduler.schedule()` exactly as the engine's loop does, its time is the cost model's
prediction, and its result is applied with `Scheduler.update()`: every sampling sequence
gains one token (ignore_eos, so a request ends at its output length). No scheduling decision
is made here, so a change to the scheduler or a policy changes the replay.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chunkserve.tune.cost import _get
from scheduler_svc.block_pool import BlockPool
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.plan import Sampled, StepPlan, StepResult
from scheduler_svc.policy import create_policy
from scheduler_svc.request import Request, SamplingParams
from scheduler_svc.scheduler import Scheduler

SAMPLED_TOKEN = 1  # what the simulated executor samples; no EOS, so only the length stops a request


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What the replay needs of one request. Requests with the same prefix_group share their
    first prefix_len prompt tokens (prefix-cache hits); others share nothing."""

    arrival: float  # seconds from the start of the log
    prompt_len: int
    output_len: int
    cls: str = "all"
    prefix_group: int | None = None
    prefix_len: int = 0


@dataclass(slots=True)
class ReplayedRequest:
    spec: RequestSpec
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.spec.arrival

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.spec.arrival


@dataclass(slots=True)
class StepLog:
    """What one replayed step carried."""

    time: float  # when it ended
    seconds: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache by requests admitted in it


@dataclass(slots=True)
class ReplayResult:
    requests: list[ReplayedRequest]
    steps: list[StepLog]
    duration: float  # first arrival to last token
    free_blocks_at_end: int
    num_blocks: int

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preempted for s in self.steps)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the replayed requests found in the prefix cache."""
        return sum(s.num_cached_tokens for s in self.steps)


def _prompt(i: int, spec: RequestSpec) -> list[int]:
    """Token ids: a shared prefix per group, then tokens no other request has (no cache hits)."""
    shared = [1_000_000 + (spec.prefix_group or 0)] * (spec.prefix_len if spec.prefix_group is not None else 0)
    shared = shared[: spec.prompt_len]
    return shared + [2_000_000 + i] * (spec.prompt_len - len(shared))


def build_scheduler(
    config: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int, num_host_blocks: int = 0
) -> Scheduler:
    """Pool, host pool and scheduler as scheduler_svc/app.py builds them from a handshake."""
    host_pool = BlockPool(num_host_blocks, block_size) if num_host_blocks else None
    pool = BlockPool(num_blocks, block_size, enable_caching=config.enable_prefix_caching)
    return Scheduler(config, pool, create_policy(config.scheduling_policy), max_model_len, host_pool)


def replay(
    specs: Sequence[RequestSpec],
    config: SchedulerConfig,
    step_seconds: Callable[[list[tuple[int, int, int]]], float],
    num_blocks: int,
    block_size: int = 16,
    max_model_len: int | None = None,
    num_host_blocks: int = 0,
    on_plan: Callable[[Scheduler, StepPlan], None] | None = None,
    max_steps: int = 10_000_000,
) -> ReplayResult:
    """Runs the request log through a fresh scheduler; `step_seconds` maps a step's
    (new tokens, computed tokens, prompt tokens) per sequence to its duration
    (`CostModel.predict`). `on_plan` sees every plan before it is applied (tests)."""
    order = sorted(range(len(specs)), key=lambda i: (specs[i].arrival, i))
    longest = max((s.prompt_len + s.output_len for s in specs), default=2)
    mml = max_model_len or longest
    if longest > mml:
        raise ValueError(f"a request needs {longest} tokens, more than max_model_len {mml}")
    sched = build_scheduler(config, num_blocks, block_size, mml, num_host_blocks)
    live: dict[str, ReplayedRequest] = {}
    replayed = [ReplayedRequest(s) for s in specs]
    steps: list[StepLog] = []
    clock = specs[order[0]].arrival if specs else 0.0
    nxt = 0
    for _ in range(max_steps):
        while nxt < len(order) and specs[order[nxt]].arrival <= clock:
            i = order[nxt]
            spec = specs[i]
            request = Request(
                request_id=f"q{i}",
                seq_id=i + 1,
                prompt_token_ids=_prompt(i, spec),
                sampling=SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True),
                arrival_time=spec.arrival,
            )
            live[request.request_id] = replayed[i]
            sched.add_request(request)
            nxt += 1
        if not sched.has_work():
            if nxt == len(order):
                break
            clock = specs[order[nxt]].arrival  # idle until the next arrival
            continue
        plan = sched.schedule()
        if plan.is_empty:  # nothing fits until something else arrives (the engine waits too)
            if nxt == len(order):
                raise RuntimeError("the replay is stuck: work left, nothing schedulable, no arrivals")
            clock = max(clock, specs[order[nxt]].arrival)
            continue
        if on_plan is not None:
            on_plan(sched, plan)
        shape = [
            (s.num_new_tokens, s.num_computed_tokens, r.num_prompt_tokens)
            for s, r in zip(plan.seqs, sched.step_stats.requests)
        ]
        dt = step_seconds(shape)
        clock += dt
        if config.target_itl_ms is not None:  # the auto budget learns the simulated step, as on a server
            sched.budget.observe(plan, sched.step_stats, dt)
        for rid in plan.preempted:
            live[rid].num_preemptions += 1
        result = StepResult(plan.step_id, [Sampled(s.seq_id, SAMPLED_TOKEN) for s in plan.seqs if s.sample])
        for out in sched.update(plan, result):
            live[out.request.request_id].token_times.append(clock)
        prefill = sum(n for n, c, p in shape if not (n == 1 and c >= p))
        hits = sched.step_stats.prefix_hits
        steps.append(StepLog(clock, dt, prefill, plan.num_tokens - prefill, len(plan.preempted), hits))
    else:
        raise RuntimeError(f"the replay did not finish in {max_steps} steps")
    start = min((s.arrival for s in specs), default=0.0)
    return ReplayResult(replayed, steps, max(0.0, clock - start), sched.pool.num_free_blocks, sched.pool.num_blocks)


# ---- request logs --------------------------------------------------------------------------


def _bench_prefixes(report: dict, n: int) -> tuple[list[int | None], list[int]]:
    """Shared-prefix structure of a bench report: its prefix_groups / prefix_lens lists, or
    for reports written before those lists, the shared-prefix workload's `prefix-<g>` class
    labels and its --prefix-len."""
    if report.get("prefix_groups") is not None:
        groups = list(report["prefix_groups"])
        return groups, [int(x or 0) for x in report.get("prefix_lens") or [0] * n]
    classes = report.get("classes") or [""] * n
    length = int((report.get("bench") or {}).get("prefix_len") or 0)
    groups = [int(c[7:]) if c.startswith("prefix-") and c[7:].isdigit() and length else None for c in classes]
    return groups, [length if g is not None else 0 for g in groups]


def requests_from_bench(path: str | Path) -> tuple[list[RequestSpec], dict]:
    """Request log from a `chunkserve bench --result-json` file (its per-request lists:
    arrivals, input_lens, output_lens, classes, and the shared-prefix structure
    prefix_groups / prefix_lens); failed requests are left out. Also returns
    the report's server_info (block size, KV blocks, max_model_len) when it has one.
    Several runs of one configuration (--rounds) are pooled in the lists; only the first
    round's requests are replayed then (arrival offsets restart at each round)."""
    report = json.loads(Path(path).read_text())
    if not isinstance(report, dict) or "input_lens" not in report:
        raise ValueError(f"{path}: no per-request lists (input_lens); record it with `chunkserve bench --result-json`")
    arrivals = report.get("arrivals") or [0.0] * len(report["input_lens"])
    errors = report.get("errors") or [""] * len(arrivals)
    classes = report.get("classes") or ["all"] * len(arrivals)
    groups, prefix_lens = _bench_prefixes(report, len(arrivals))
    specs = []
    for i, (a, inp, out) in enumerate(zip(arrivals, report["input_lens"], report["output_lens"])):
        if i > 0 and a < arrivals[i - 1]:
            break  # arrival offsets restart: the next round
        if errors[i] or not out:
            continue
        group = groups[i] if i < len(groups) else None
        plen = min(int(inp), prefix_lens[i]) if group is not None and i < len(prefix_lens) else 0
        specs.append(RequestSpec(float(a), int(inp), int(out), classes[i] or "all", group, plen))
    return specs, report.get("server_info") or {}


def is_step_trace(path: str | Path) -> bool:
    """Whether a file is a step trace (JSON lines of steps) rather than a bench report."""
    with open(path) as f:
        first = next((line for line in f if line.strip()), "")
    try:
        head = json.loads(first)
    except ValueError:
        return False  # a pretty-printed bench report: its first line is not a whole document
    return isinstance(head, dict) and "input_lens" not in head


def load_requests(path: str | Path) -> tuple[list[RequestSpec], dict]:
    """A request log from either a bench report or a step trace (server_info {} then)."""
    return (requests_from_trace(path), {}) if is_step_trace(path) else requests_from_bench(path)


def requests_from_trace(path: str | Path) -> list[RequestSpec]:
    """Request log from a step trace: a request arrives at the first step that computed it (a
    lower bound on its queueing: the true arrival is earlier by its queue time), its prompt
    length is numPromptTokens, its output length the tokens it sampled (its final prefill
    chunk and every decode).

    Shared prefixes (from the entries' numCachedTokens and prefixHash): requests whose
    first KV block has the same hash form a group when at least one of them found tokens in
    the prefix cache; the group's prefix length is the upper median of its members' hits
    (a member's own hit when larger), so the request that first computed a prefix is in the
    group too, and the replay decides again which requests hit. One level of sharing per
    group: requests that share a first block but different longer prefixes are merged."""
    first: dict[str, float] = {}
    prompt: dict[str, int] = {}
    outputs: dict[str, int] = {}
    cached: dict[str, int] = {}
    block: dict[str, str] = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            t = float(_get(d, "timestamp", "timestamp", 0.0))
            for s in _get(d, "seqs", "seqs", []):
                rid = _get(s, "requestId", "request_id", "")
                n = int(_get(s, "numTokens", "num_tokens"))
                c = int(_get(s, "numComputedTokens", "num_computed_tokens"))
                p = int(_get(s, "numPromptTokens", "num_prompt_tokens"))
                first.setdefault(rid, t)
                prompt[rid] = p
                if hit := int(_get(s, "numCachedTokens", "num_cached_tokens")):
                    cached.setdefault(rid, hit)
                if h := _get(s, "prefixHash", "prefix_hash", ""):
                    block.setdefault(rid, h)
                if n == 1 and c >= p:
                    outputs[rid] = outputs.get(rid, 0) + 1
                elif c + n >= p and c < p:  # the chunk that reaches the prompt's end samples
                    outputs[rid] = outputs.get(rid, 0) + 1
    if not first:
        raise ValueError(f"{path}: no steps with sequences in this trace")
    t0 = min(first.values())
    p50 = sorted(prompt.values())[len(prompt) // 2]
    hits: dict[str, list[int]] = {}
    for rid, h in block.items():
        if cached.get(rid):
            hits.setdefault(h, []).append(cached[rid])
    names: dict[str, int] = {}  # prefix hash -> group number, in order of first arrival
    specs = []
    for r in sorted(first, key=lambda r: first[r]):
        group, plen = None, 0
        if (h := block.get(r)) in hits:
            group_len = sorted(hits[h])[len(hits[h]) // 2]
            group, plen = names.setdefault(h, len(names)), min(prompt[r], max(group_len, cached.get(r, 0)))
        cls = "long" if prompt[r] > 2 * p50 else "short"
        specs.append(RequestSpec(first[r] - t0, prompt[r], max(1, outputs.get(r, 1)), cls, group, plen))
    return specs
