"""The randomized scheduler test: hypothesis-generated workloads, every invariant after every step.

A scenario is a pool (block size 1 to 16, a few blocks, optionally a small host pool), a
preemption mode, prefix caching on or off, a starting configuration (any policy, budget,
seq cap, partial-prefill caps, chunking on or off), requests that arrive over time (prompts
cut from a few shared prefixes, so the prefix cache hits; priorities, tenants, salts),
aborts of requests in a chosen state (waiting, mid-prefill, decoding, swapped; between
steps or while the step is in flight), live reconfigurations between steps
(`Scheduler.reconfigure`, as the Admin service does; the auto budget among them), async
scheduling or not (step N+1 planned before step N's result is applied, as engine.py's
`_loop_async`) and steps the executor refuses (their requests fail; under async scheduling
those of the step planned on top start over, as engine.py does). `simulate` plays it step
by step against the KV-simulating FakeExecutor (conftest.py) and checks after every step:

- budget: the plan's tokens <= max_num_batched_tokens and seqs <= max_num_seqs, under the
  configuration the plan was built with; with chunking off an admitted prompt is whole;
- blocks: the queues partition the live requests; every device block's ref count equals the
  number of live tables holding it (free + referenced == num_blocks, sum of ref counts ==
  sum of table lengths); a block is shared only as the same cached full block of a prefix;
  the host pool likewise against the swapped requests' host blocks (never shared); the
  executor's tables equal the scheduler's; the executor knows exactly the live sequences
  the scheduler thinks it knows;
- exact blocks: a scheduled request holds ceil((num_computed + n) / block_size) blocks, every
  other running one ceil(num_computed / block_size), a swapped one as many host blocks,
  a waiting one none;
- no cross-request writes: the FakeExecutor asserts it on every KV slot it writes;
- host blocks: a host block read by a swap-in of step N is not the destination of a swap-out
  of step N (the executor copies swap-outs first);
- decodes first (issue #32): a request running and decoding as the step began (one known
  token without KV, not ended by its token in flight) is in every step that schedules a
  prefill chunk (more than one token, or short of the last known token), pinned or not,
  unless it was preempted in that step (blocks ran out); with chunking off a step that
  admits prompts whole runs nothing else, by design;
- cursors: num_computed_tokens never decreases, except to 0 for a request the step's plan
  lists as preempted and which went back to waiting (recompute); a swapped request keeps it;
- forward progress (README: "a request preempted --max-preemptions times is pinned, so the
  oldest request always makes progress"): a request pinned when the step began
  (num_preemptions >= max_preemptions) is preempted only when no unpinned request is running
  once the step is planned; the oldest live request (arrival order), once pinned, is
  preempted only when no other request is running at all, and with chunked prefill, while
  it runs, it is scheduled in every step whose decodes leave it a token and a seq slot
  (unless it preempted itself, as above), so it finishes; a request whose last token is in
  flight (it ends with that step) is no victim (issue #32) and does not count as running
  here; the run drains within `step_bound` steps (a livelock guard);
- no leak: once every request finished or was aborted, every device and host block is free,
  check_invariants() passes, the executor holds no sequence;
- outputs: every request that was not aborted (or failed) has the token ids and finish
  reason of a reference run of the same requests (huge pool, chunking on, caching off, big
  budget, fcfs), and an aborted or failed one a prefix of them. The FakeExecutor's next
  token is a pure function of the KV it reads back, so wrong KV changes tokens.

Six cases: recompute, swap, and swap "churn" (chunked, small budgets, a few long prompts among
many short ones, every step preempting, swapping or resuming something), each with prefix
caching on and off. The bounded run, part of the suite (~40 s of CPU), is derandomized, 100
scenarios a case, and does not shrink a failure: it prints the scenario as found. Shrunk:

    CHUNKSERVE_RANDOMIZED_SHRINK=1 .venv/bin/python -m pytest tests/scheduler_svc/test_randomized.py

(minutes per failing case). A longer, random run, N scenarios in all (12000 took 22 minutes
on a busy 2-core machine; it shrinks, and saves failures in .hypothesis/ to replay first):

    CHUNKSERVE_RANDOMIZED_EXAMPLES=20000 .venv/bin/python -m pytest tests/scheduler_svc/test_randomized.py -q

Add `--hypothesis-show-statistics` to see how often a run aborted in each state, swapped,
hit the cache, preempted a pinned request. Replay a printed scenario with
`simulate(fakes, Scenario(...))` (the failure names its step and requests).

The `test_regression_*` tests are deterministic repros of scheduler bugs of issues #13 and #32.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field

import hypothesis
import hypothesis.errors
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from scheduler_svc.block_pool import BlockPool, blocks_needed
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.plan import StepPlan, StepStats
from scheduler_svc.policy import create_policy
from scheduler_svc.request import FinishReason, Request, RequestStatus, SamplingParams
from scheduler_svc.scheduler import Scheduler

POLICIES = ("fcfs", "priority", "sjf", "fair")
ABORT_STATES = ("waiting", "prefilling", "decoding", "swapped", "any")

_CASES = 6  # the parametrizations of test_random_scenarios_keep_every_invariant
_LONG_RUN = int(os.environ.get("CHUNKSERVE_RANDOMIZED_EXAMPLES", "0"))
_SHRINK = os.environ.get("CHUNKSERVE_RANDOMIZED_SHRINK", "") not in ("", "0")
_HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]
if _LONG_RUN > 0:
    RANDOMIZED = settings(
        max_examples=-(-_LONG_RUN // _CASES), deadline=None, print_blob=True, suppress_health_check=_HEALTH
    )
else:  # shrinking a failure takes minutes per case: only on request
    RANDOMIZED = settings(
        max_examples=100,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=_HEALTH,
        phases=tuple(Phase) if _SHRINK else tuple(p for p in Phase if p is not Phase.shrink),
    )


# ---- scenarios ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What the Admin service can change live (plus the policy at start)."""

    max_num_batched_tokens: int
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 4
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    target_itl_ms: float | None = None  # the auto token budget (scheduler_svc/budget.py)


@dataclass(frozen=True)
class Req:
    arrival_step: int
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    tenant: str = ""
    cache_salt: str | None = None


@dataclass(frozen=True)
class Abort:
    """Aborts request `request` (an index into Scenario.requests) the first time it is in
    `state` at least `not_before` steps after its arrival, between steps or, `in_flight`,
    after a step is planned and before its result is applied (its state then is the one the
    plan put it in: just swapped out, just admitted...)."""

    request: int
    state: str  # one of ABORT_STATES
    not_before: int = 0
    in_flight: bool = False


@dataclass(frozen=True)
class Reconfig:
    step: int
    settings: Settings
    policy: str | None = None  # None: keep the policy object (and its state)


@dataclass(frozen=True)
class Scenario:
    block_size: int
    num_blocks: int
    max_model_len: int
    settings: Settings
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    num_host_blocks: int = 0
    lifo_host_pool: bool = False  # the host pool hands out the most recently freed blocks first
    enable_prefix_caching: bool = True
    max_preemptions: int = 8
    eos_after: int | None = None
    requests: tuple[Req, ...] = ()
    aborts: tuple[Abort, ...] = ()
    reconfigs: tuple[Reconfig, ...] = ()
    # Step N+1 is planned before step N's result is applied (--async-scheduling, engine.py).
    async_scheduling: bool = False
    # Plans (by step id) the executor refuses: their requests fail, and under async scheduling
    # the requests of the step planned on top of one start over (engine.py).
    failed_steps: tuple[int, ...] = ()
    first_id: int = 0  # request i is f"r{first_id + i}" (the regression tests use the names)


@st.composite
def settings_strategy(draw, max_model_len: int) -> Settings:
    chunked = draw(st.booleans())
    # Chunking off needs a budget that holds the longest request (the Admin service refuses less).
    budget = draw(
        (st.integers(1, max_model_len) | st.integers(1, 8))
        if chunked
        else st.integers(max_model_len, max_model_len + 16)
    )
    partial = draw(st.integers(1, 4))
    return Settings(
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.sampled_from([128, 2, 3, 4, 8, 1])),
        enable_chunked_prefill=chunked,
        max_num_partial_prefills=partial,
        max_long_partial_prefills=draw(st.integers(1, partial)),
        long_prefill_token_threshold=draw(st.just(0) | st.integers(1, 8) | st.integers(1, max_model_len)),
        target_itl_ms=draw(st.none() | st.sampled_from([0.5, 2.0, 8.0, 1e4])) if chunked else None,
    )


@st.composite
def scenarios(
    draw, preemption_mode: str | None = None, enable_prefix_caching: bool | None = None, churn: bool = False
) -> Scenario:
    """Any scenario; `churn` ones are all chunked, with small budgets and long-prefill
    thresholds, a pool and a host pool just over one request, a few long prompts among many
    short ones that decode for long: every step preempts, swaps and resumes something."""
    # The server refuses a max_model_len its pool cannot hold: the pool holds one longest
    # request plus a few blocks, so that concurrent requests run out of blocks.
    max_model_len = draw(st.integers(16, 40) if churn else st.integers(2, 40) | st.integers(16, 40))
    block_size = draw(st.sampled_from([2, 4, 8] if churn else [1, 2, 3, 4, 8, 16]))
    need = blocks_needed(max_model_len, block_size)
    num_blocks = need + draw(st.integers(0, 2 if churn else need // 2 + 1))
    mode = preemption_mode or draw(st.sampled_from(["recompute", "swap"]))
    prefixes = draw(
        st.lists(st.lists(st.integers(0, 3), min_size=max_model_len, max_size=max_model_len), min_size=1, max_size=3)
    )
    requests, arrival = [], 0
    for i in range(draw(st.integers(6 if churn else 2, 14))):
        arrival += draw(st.sampled_from([0, 0, 1, 2] if churn else [0, 0, 1, 2, 4]))
        # Long prompts (chunked over steps, "long" partial prefills) and short ones that decode
        # for long; each starts with part of a shared prefix.
        if (i == 0 or draw(st.integers(0, 3)) == 0) if churn else draw(st.booleans()):
            length = draw(st.integers(max(1, max_model_len // 2), max_model_len - (2 if churn else 1)))
        else:
            length = draw(st.integers(1, block_size if churn else max(1, max_model_len // 4)))
        shared = draw(st.integers(0, length) | st.just(length))
        prefix = prefixes[draw(st.integers(0, len(prefixes) - 1))]
        prompt = prefix[:shared] + draw(
            st.lists(st.integers(0, 255), min_size=length - shared, max_size=length - shared)
        )
        room = max_model_len - len(prompt)
        requests.append(
            Req(
                arrival_step=arrival,
                prompt=tuple(prompt),
                max_tokens=draw(st.integers(1, room) | st.just(room)),
                priority=draw(st.integers(0, 2)),
                tenant=draw(st.sampled_from(["a", "b", "c"])),
                cache_salt=draw(st.sampled_from([None, None, None, "s"])),
            )
        )
    aborts = [
        draw(
            st.builds(
                Abort,
                st.integers(0, len(requests) - 1),
                st.sampled_from(ABORT_STATES),
                st.sampled_from([0, 1, 2, 4, 8]),
                st.booleans(),
            )
        )
        for _ in range(draw(st.integers(0, 4)))
    ]
    if churn:
        settings = Settings(
            max_num_batched_tokens=draw(st.integers(block_size, max_model_len // 2) | st.integers(1, 8)),
            long_prefill_token_threshold=draw(st.integers(1, 2 * block_size)),
        )
        reconfigs = []
    else:
        settings = draw(settings_strategy(max_model_len))
        reconfigs = draw(
            st.lists(
                st.builds(
                    Reconfig,
                    st.integers(1, arrival + 12),
                    settings_strategy(max_model_len),
                    st.none() | st.sampled_from(POLICIES),
                ),
                max_size=3,
            )
        )
    return Scenario(
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        settings=settings,
        policy=draw(st.sampled_from(POLICIES)),
        preemption_mode=mode,
        # A host pool about one long request's size: swap-outs often find it nearly full.
        num_host_blocks=(
            draw(
                st.integers(need // 2, need) if churn else st.integers(need // 2, need) | st.integers(0, 2 * num_blocks)
            )
            if mode == "swap"
            else 0
        ),
        lifo_host_pool=draw(st.booleans()),
        enable_prefix_caching=(draw(st.booleans()) if enable_prefix_caching is None else enable_prefix_caching),
        max_preemptions=draw(st.integers(1, 3)),
        eos_after=draw(st.integers(max_model_len // 2, max_model_len)) if draw(st.integers(0, 3)) == 0 else None,
        requests=tuple(requests),
        aborts=tuple(aborts),
        reconfigs=tuple(reconfigs),
        async_scheduling=draw(st.booleans()),
        failed_steps=tuple(draw(st.lists(st.integers(0, 30), max_size=2))) if draw(st.integers(0, 3)) == 0 else (),
    )


# ---- the harness -------------------------------------------------------------------------


class LifoPool(BlockPool):
    """A block pool that hands out the most recently freed blocks first. Any free block is
    fair game for the scheduler, and this order reuses a block freed too early at once: with
    the default order (least recently freed first) a host block released by a swap-in is
    only reused by a swap-out of the same step when the host pool is nearly full."""

    def take(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            return super().take(n)  # raises
        free = super().take(self.num_free_blocks)  # least recently freed first
        keep, give = free[: len(free) - n], free[len(free) - n :]
        self.release(keep[::-1])  # back, in the same order (release() goes last to first)
        return give[::-1]


def event(name: str) -> None:
    """hypothesis.event (for --hypothesis-show-statistics), a no-op outside @given."""
    try:
        hypothesis.event(name)
    except hypothesis.errors.InvalidArgument:
        pass


def make_request(i: int, spec: Req, eos: int) -> Request:
    """Request number i; arrival_time = i, so arrival order is number order."""
    return Request(
        request_id=f"r{i}",
        seq_id=i,
        prompt_token_ids=list(spec.prompt),
        # Every third request penalized: the FakeExecutor checks the token ids it is sent for
        # the penalties against its KV through preemption, prefix hits and restarts.
        # and every fourth asks for prompt logprobs (checked once it has a token); every fifth
        # has bad words, which need the same token ids.
        sampling=SamplingParams(
            temperature=0.0,
            max_tokens=spec.max_tokens,
            presence_penalty=0.5 * (i % 3 == 0),
            prompt_logprobs=1 if i % 4 == 0 else None,
            bad_words=((3, 4),) if i % 5 == 0 else (),
        ),
        eos_token_ids=frozenset({eos}),
        arrival_time=float(i),
        priority=spec.priority,
        tenant=spec.tenant,
        cache_salt=spec.cache_salt,
    )


def scheduler_config(sc: Scenario, s: Settings, policy: str) -> SchedulerConfig:
    return SchedulerConfig(
        **dataclasses.asdict(s),
        enable_prefix_caching=sc.enable_prefix_caching,
        scheduling_policy=policy,
        preemption_mode=sc.preemption_mode,
        max_preemptions=sc.max_preemptions,
    )


def reference_outputs(fakes, sc: Scenario) -> dict[str, tuple[list[int], FinishReason]]:
    """Each request's greedy tokens and finish reason with nothing constraining it: every
    request at step 0, a pool that holds them all, chunking on, caching off, a huge budget."""
    bs = 16
    num_blocks = sum(blocks_needed(len(r.prompt) + r.max_tokens, bs) for r in sc.requests) + 1
    config = SchedulerConfig(
        max_num_batched_tokens=1 << 20, max_num_seqs=1 << 20, enable_chunked_prefill=True, enable_prefix_caching=False
    )
    sched = Scheduler(config, BlockPool(num_blocks, bs), create_policy("fcfs"), sc.max_model_len)
    fake = fakes.FakeExecutor(num_blocks, bs, eos_after=sc.eos_after)
    reqs = [make_request(i, spec, fakes.EOS) for i, spec in enumerate(sc.requests, start=sc.first_id)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(len(reqs) * (sc.max_model_len + 2)):
        if not sched.has_work():
            break
        sched.update(plan := sched.schedule(), fake.execute(plan))
    assert not sched.has_work(), "the reference run did not finish"
    return {r.request_id: (list(r.output_token_ids), r.finish_reason) for r in reqs}


def step_bound(sc: Scenario) -> int:
    """A livelock guard, not a latency bound: arrivals plus, per request, its tokens computed
    up to (max_preemptions + 2) times (pinned requests can still be preempted when everyone
    running is pinned) at one token per step, plus a step per preemption and abort."""
    work = sum(len(r.prompt) + r.max_tokens for r in sc.requests)
    last = max([r.arrival_step for r in sc.requests] + [c.step for c in sc.reconfigs])
    return last + 50 + 4 * (sc.max_preemptions + 2) * (work + len(sc.requests))


@dataclass
class Trace:
    """What a simulated run did, for statistics and the regression tests."""

    steps: int = 0
    preemptions: int = 0
    swap_ins: int = 0
    swap_outs: int = 0
    cache_hits: int = 0
    aborted: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)  # by a failed step (Scenario.failed_steps)
    preempted: Counter[str] = field(default_factory=Counter)  # request id -> times preempted
    preempted_at: dict[str, list[int]] = field(default_factory=dict)  # request id -> steps
    first_pinned_step: dict[str, int] = field(default_factory=dict)  # first step it ran pinned
    finish_step: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)  # only when simulate(strict=False)


@dataclass
class Sent:
    """A step sent to the executor, and what it must hold once it ran."""

    plan: StepPlan
    stats: StepStats
    known: set[int]  # the sequences the scheduler thought the executor knows after it
    tables: dict[int, list[int]]  # its sequences' block tables after it


class HostBlockReused(AssertionError):
    """A swap-out overwrote a host block that a swap-in of the same step reads."""


class NoForwardProgress(AssertionError):
    """A pinned request was preempted, or the oldest one did not progress."""


class WrongTokens(AssertionError):
    """A request's tokens differ from the reference run's."""


class WastedPreemption(AssertionError):
    """A request whose last token was in flight (it ends with that step) was preempted."""


class DecodeWaitsOnPrefill(AssertionError):
    """A running decode was left out of a step that scheduled a prefill chunk."""


def is_decoding(r: Request, max_model_len: int) -> bool:
    """Whether r, as the next plan begins, is a running decode the plan can hold: one known
    token without KV, not ended by a token in flight, that token known to the executor or by id."""
    return (
        r.status is RequestStatus.RUNNING
        and r.num_remaining_tokens == 1
        and not r.ends_by_length(max_model_len)
        and (r.executor_has_last_token or r.num_inflight_tokens == 0)
    )


def decodes_left_out(sched: Scheduler, plan, decoding: set[str], admitted: bool) -> list[str]:
    """The decodes (`decoding`, as the plan began) that `plan` left out although it scheduled a
    prefill chunk (more tokens than one, or short of the last known token): "decodes are never
    stalled by a prefill" (issue #32, item 6), pinned requests included. A decode may miss a
    step only as a preemption victim (blocks ran out) or when decodes alone fill the step's
    budget or max_num_seqs, and then no prefill chunk is in it; with chunking off, a step that
    `admitted` prompts whole runs nothing else, by design (README)."""
    if admitted and not sched.config.enable_chunked_prefill:
        return []
    if not any(e.num_new_tokens > 1 or not e.sample for e in plan.seqs):
        return []
    return sorted(decoding - {e.request_id for e in plan.seqs} - set(plan.preempted))


def _state(r: Request) -> str:
    if r.status is RequestStatus.WAITING:
        return "waiting"
    if r.status is RequestStatus.SWAPPED:
        return "swapped"
    return "decoding" if r.num_remaining_tokens <= 1 and not r.is_prefilling else "prefilling"


def check_pools(sched: Scheduler, fake) -> None:
    """Block and queue accounting of the device and host pools; valid between any two calls."""
    live = sched.requests
    queued = [r.request_id for q in (sched.running, sched.waiting, sched.swapped) for r in q]
    assert sorted(queued) == sorted(live), f"queues {queued} are not the live requests {sorted(live)}"
    for q, status in (
        (sched.running, RequestStatus.RUNNING),
        (sched.waiting, RequestStatus.WAITING),
        (sched.swapped, RequestStatus.SWAPPED),
    ):
        for r in q:
            assert r.status is status, f"{r.request_id} is {r.status} in the {status.value} queue"
    pool, bs = sched.pool, sched.pool.block_size
    pool.check_invariants()
    refs: Counter[int] = Counter()
    holders: dict[int, list[tuple[Request, int]]] = {}
    for r in live.values():
        assert len(set(r.block_ids)) == len(r.block_ids), f"{r.request_id} holds a block twice: {r.block_ids}"
        if r.status is RequestStatus.WAITING:
            assert not r.block_ids and not r.host_block_ids, f"waiting {r.request_id} holds blocks"
            assert r.num_computed_tokens == 0, f"waiting {r.request_id} has computed tokens"
        elif r.status is RequestStatus.SWAPPED:
            assert not r.block_ids, f"swapped {r.request_id} holds device blocks"
            assert len(r.host_block_ids) == blocks_needed(r.num_computed_tokens, bs), (
                f"swapped {r.request_id}: {len(r.host_block_ids)} host blocks for {r.num_computed_tokens} tokens"
            )
        else:
            assert not r.host_block_ids, f"running {r.request_id} holds host blocks"
        refs.update(r.block_ids)
        for i, b in enumerate(r.block_ids):
            holders.setdefault(b, []).append((r, i))
    for block in pool.blocks:
        assert block.ref_count == refs[block.block_id], (
            f"device block {block.block_id}: ref count {block.ref_count}, held by {refs[block.block_id]} tables"
        )
    referenced = sum(1 for b in pool.blocks if b.ref_count)
    assert pool.num_free_blocks + referenced == pool.num_blocks, "device: free + referenced != num_blocks"
    assert pool.num_used_references() == sum(len(r.block_ids) for r in live.values())
    for b, hs in holders.items():
        if len(hs) > 1:  # only a cached full prefix block is shared, at the same position
            assert pool.blocks[b].block_hash is not None, f"block {b} shared by {len(hs)} but not cached"
            assert len({i for _, i in hs}) == 1 and all(i < len(r.block_hashes) for r, i in hs), (
                f"block {b} shared at positions {[(r.request_id, i) for r, i in hs]}"
            )
    host = sched.host_pool
    if host is not None:
        host.check_invariants()
        host_refs = Counter(b for r in sched.swapped for b in r.host_block_ids)
        for block in host.blocks:
            assert block.ref_count == host_refs[block.block_id] <= 1, (
                f"host block {block.block_id}: ref count {block.ref_count}, held {host_refs[block.block_id]} times"
            )
        assert host.num_free_blocks + sum(1 for b in host.blocks if b.ref_count) == host.num_blocks
        assert host.num_used_references() == sum(len(r.host_block_ids) for r in sched.swapped)
    else:
        assert all(not r.host_block_ids for r in live.values())


def simulate(fakes, sc: Scenario, strict: bool = True, reference=None) -> Trace:
    """Plays scenario sc, checking every invariant after every step (see the module docstring).

    strict=False records host-reuse, forward-progress and wrong-token violations in
    trace.violations and goes on, for the regression tests; every other check always raises.
    Each kind raises its own exception type, so hypothesis reports (and shrinks) them apart.
    """
    trace = Trace()

    def violation(ok: bool, kind: type[AssertionError], message: str) -> None:
        if not ok:
            if strict:
                raise kind(message)
            trace.violations.append(message)

    policy_name = sc.policy
    sched = Scheduler(
        scheduler_config(sc, sc.settings, policy_name),
        BlockPool(sc.num_blocks, sc.block_size, enable_caching=sc.enable_prefix_caching),
        create_policy(policy_name),
        sc.max_model_len,
        (LifoPool if sc.lifo_host_pool else BlockPool)(sc.num_host_blocks, sc.block_size)
        if sc.num_host_blocks
        else None,
    )
    fake = fakes.FakeExecutor(sc.num_blocks, sc.block_size, eos_after=sc.eos_after, num_host_blocks=sc.num_host_blocks)
    bs, pin = sc.block_size, sc.max_preemptions
    reqs = [make_request(i, spec, fakes.EOS) for i, spec in enumerate(sc.requests, start=sc.first_id)]
    arrival = {r.request_id: spec.arrival_step for r, spec in zip(reqs, sc.requests)}
    pending = list(reqs)
    bound = step_bound(sc)
    last_event = max([r.arrival_step for r in sc.requests] + [c.step for c in sc.reconfigs])

    def abort(step: int, in_flight: bool) -> None:
        for a in sc.aborts:
            victim = reqs[a.request]
            if (
                a.in_flight == in_flight
                and victim.request_id in sched.requests
                and step >= sc.requests[a.request].arrival_step + a.not_before
                and a.state in ("any", _state(victim))
            ):
                event(f"abort {_state(victim)}{' in flight' if in_flight else ''}")
                sched.abort(victim.request_id)
                trace.aborted.add(victim.request_id)

    def plan_step(step: int) -> Sent | None:
        """Plans a step and checks it; None when there is nothing to send (as the engine)."""
        config = sched.config
        before = {rid: (r.status, r.num_computed_tokens, r.num_preemptions) for rid, r in sched.requests.items()}
        tokens_before = {rid: (r.num_tokens, r.num_inflight_tokens) for rid, r in sched.requests.items()}
        oldest = min(sched.requests.values(), key=lambda r: (r.arrival_time, r.seq_id), default=None)
        decoding = {r.request_id for r in sched.running if is_decoding(r, sc.max_model_len)}
        ending = {r.request_id for r in sched.running if r.ends_by_length(sc.max_model_len)}
        plan = sched.schedule()
        trace.steps += 1
        where = f"step {plan.step_id}"
        assert plan.num_tokens <= config.max_num_batched_tokens, (
            f"{where}: {plan.num_tokens} tokens over the budget {config.max_num_batched_tokens}"
        )
        assert plan.num_tokens <= sched.step_stats.token_budget <= config.max_num_batched_tokens, (
            f"{where}: {plan.num_tokens} tokens, step budget {sched.step_stats.token_budget}"
        )
        if sched.step_stats.budget_reason:
            event(f"auto budget: {sched.step_stats.budget_reason}")
        assert len(plan.seqs) <= config.max_num_seqs, f"{where}: {len(plan.seqs)} seqs over {config.max_num_seqs}"
        assert len({e.seq_id for e in plan.seqs}) == len(plan.seqs), f"{where}: a sequence twice in a plan"
        check_pools(sched, fake)
        admitted = any(before[e.request_id][0] is RequestStatus.WAITING for e in plan.seqs)
        left_out = decodes_left_out(sched, plan, decoding, admitted)
        violation(
            not left_out,
            DecodeWaitsOnPrefill,
            f"{where}: decodes {left_out} left out of a step with prefill chunks, scheduled (* = pinned): "
            + ", ".join(f"{e.request_id}{'*' * (before[e.request_id][2] >= pin)}+{e.num_new_tokens}" for e in plan.seqs)
            + f"; budget {sched.step_stats.token_budget}, pinned {[r for r in decoding if before[r][2] >= pin]}",
        )
        scheduled = {}
        for e in plan.seqs:
            r = sched.requests[e.request_id]
            scheduled[e.request_id] = e
            if r.num_preemptions >= sc.max_preemptions:
                trace.first_pinned_step.setdefault(r.request_id, step)
            assert r.status is RequestStatus.RUNNING, f"{where}: {r.request_id} scheduled but {r.status}"
            # The plan is committed as it is built: the cursor is past the entry, and a
            # sampling entry left one more in-flight token.
            known, inflight = tokens_before[r.request_id]
            assert e.num_new_tokens >= 1 and e.num_computed_tokens + e.num_new_tokens == r.num_computed_tokens
            assert (
                before[r.request_id][1] == e.num_computed_tokens or before[r.request_id][0] is not RequestStatus.RUNNING
            )
            assert e.num_computed_tokens + e.num_new_tokens <= known
            assert e.sample == (e.num_computed_tokens + e.num_new_tokens == known)
            assert r.num_inflight_tokens == inflight + e.sample
            assert len(r.block_ids) == blocks_needed(e.num_computed_tokens + e.num_new_tokens, bs), (
                f"{where}: {r.request_id} holds {len(r.block_ids)} blocks for {e.num_computed_tokens}+{e.num_new_tokens}"
            )
            if before[r.request_id][0] is RequestStatus.WAITING:
                if e.num_computed_tokens:
                    trace.cache_hits += 1
                    event("prefix-cache hit")
                if not config.enable_chunked_prefill:
                    assert e.num_computed_tokens + e.num_new_tokens == known, (
                        f"{where}: chunking off but {r.request_id}'s prompt was admitted in part"
                    )
        if not config.enable_chunked_prefill:
            admitted = [rid for rid in scheduled if before[rid][0] is RequestStatus.WAITING]
            assert not admitted or len(admitted) == len(scheduled), (
                f"{where}: chunking off but admissions {admitted} share the step with running requests"
            )
        for r in sched.running:
            if r.request_id not in scheduled:
                assert len(r.block_ids) == blocks_needed(r.num_computed_tokens, bs), (
                    f"{where}: unscheduled {r.request_id} holds {len(r.block_ids)} blocks for {r.num_computed_tokens}"
                )
        # Cursors move back only through a recorded recompute preemption.
        preempted = set(plan.preempted)
        assert len(preempted) == len(plan.preempted) and not preempted & set(scheduled), (
            f"{where}: preempted {plan.preempted} twice or scheduled anyway"
        )
        for rid, r in sched.requests.items():
            if rid not in before:
                continue
            status, computed, _ = before[rid]
            if rid in preempted:
                assert status is RequestStatus.RUNNING, f"{where}: preempted {rid} was {status}"
                assert r.status in (RequestStatus.WAITING, RequestStatus.SWAPPED)
                if r.status is RequestStatus.SWAPPED:
                    assert r.num_computed_tokens == computed, f"{where}: swapped {rid} moved its cursor"
                    event("swap out")
                else:
                    event("recompute preemption")
            else:
                assert r.num_computed_tokens >= computed, (
                    f"{where}: {rid}'s cursor went back {computed} -> {r.num_computed_tokens} without a preemption"
                )
        trace.preemptions += len(preempted)
        trace.preempted.update(preempted)
        for rid in plan.preempted:
            trace.preempted_at.setdefault(rid, []).append(step)
        # Swaps: a host block a swap-in reads is not overwritten by this step's swap-outs.
        ins, outs = [h for h, _ in plan.swap_in], [h for _, h in plan.swap_out]
        assert len(set(ins)) == len(ins) and len(set(outs)) == len(outs)
        assert len({d for _, d in plan.swap_in}) == len(plan.swap_in)
        violation(
            not set(ins) & set(outs),
            HostBlockReused,
            f"{where}: host blocks {sorted(set(ins) & set(outs))} are read by a swap-in and written by "
            f"a swap-out of the same step (swap-outs run first: the swap-in reads the other KV)",
        )
        trace.swap_ins += len(ins)
        trace.swap_outs += len(outs)
        if ins:
            event("swap in")
        # Forward progress. A request whose last token is in flight ends when that step's result
        # is applied: it is skipped, and no victim (that preemption would be wasted: issue #32).
        violation(
            not preempted & ending,
            WastedPreemption,
            f"{where}: {sorted(preempted & ending)} preempted with the last token in flight",
        )
        unpinned_running = [
            r.request_id for r in sched.running if r.num_preemptions < pin and r.request_id not in ending
        ]
        for rid in plan.preempted:
            if before[rid][2] >= pin:
                event("pinned request preempted")
                violation(
                    not unpinned_running,
                    NoForwardProgress,
                    f"{where}: {rid}, pinned ({before[rid][2]} preemptions), was preempted while unpinned "
                    f"{unpinned_running} kept running",
                )
        if oldest is not None and before[oldest.request_id][2] >= pin and oldest.request_id not in ending:
            o = oldest.request_id
            others = [r.request_id for r in sched.running if r.request_id not in ending]
            violation(
                o not in preempted or not others,
                NoForwardProgress,
                f"{where}: the oldest request {o}, pinned, was preempted while {others} kept running",
            )
            # With chunked prefill the oldest pinned request, if running, gains at least one token
            # every step, unless the decodes alone need every token or seq slot of the step
            # (decodes first), or it had to preempt itself (checked just above: only when no
            # other request could be a victim), so it finishes once they are done.
            # (Chunking off, a step of whole-prompt admissions runs no running request.)
            if before[o][0] is RequestStatus.RUNNING and config.enable_chunked_prefill:
                decodes = len(decoding - {o})
                violation(
                    o in scheduled
                    or o in preempted
                    or (o not in decoding and decodes >= min(sched.step_stats.token_budget, config.max_num_seqs)),
                    NoForwardProgress,
                    f"{where}: the oldest request {o}, pinned and running, was not scheduled; step: "
                    + ", ".join(f"{e.request_id}+{e.num_new_tokens}" for e in plan.seqs)
                    + f"; preempted {plan.preempted}, decoding {sorted(decoding)}",
                )
        if plan.is_empty:
            return None
        known = {r.seq_id for r in sched.requests.values() if r.known_to_executor}
        tables = {e.seq_id: list(sched.requests[e.request_id].block_ids) for e in plan.seqs}
        return Sent(plan, sched.step_stats, known, tables)

    def fail(plan, restart: bool) -> None:
        """A step the executor refused (engine.py's _fail_step: its requests and swap victims
        fail, its drops are sent again), or, restart=True, the step planned on top of it
        (_restart_step: they start over under new sequence ids)."""
        nonlocal next_seq
        sched.drop_on_executor(plan.finished_seq_ids)
        for rid in [e.request_id for e in plan.seqs] + plan.preempted:
            r = sched.requests.get(rid)
            if r is None or (rid in plan.preempted and r.status is not RequestStatus.SWAPPED):
                continue
            if restart:
                sched.restart(r, next_seq)
                next_seq += 1
                event("restart")
            else:
                sched.finish(r, FinishReason.ABORTED)
                trace.failed.add(rid)

    def complete(done: Sent, later: Sent | None) -> bool:
        """Runs a sent step on the executor and applies its result (a step in `failed_steps`
        fails, and `later` starts over); False when it failed."""
        plan, where = done.plan, f"step {done.plan.step_id}"
        if plan.step_id in sc.failed_steps:
            event("failed step")
            fail(plan, restart=False)
            if later is not None:
                fail(later.plan, restart=True)
            return False
        result = fake.execute(plan)
        assert set(fake.seqs) == done.known, (
            f"{where}: the executor holds sequences {sorted(fake.seqs)}, the scheduler thought {sorted(done.known)}"
        )
        for seq_id, table in done.tables.items():
            assert fake.seqs[seq_id]["blocks"] == table, (
                f"{where}: the executor's table for sequence {seq_id} is {fake.seqs[seq_id]['blocks']}, not {table}"
            )
        outputs = sched.update(plan, result)
        if sched.config.target_itl_ms is not None:  # the auto budget learns a made-up, fixed step cost
            sched.budget.observe(plan, done.stats, 1e-3 + 5e-5 * plan.num_tokens + 2e-4 * len(plan.seqs))
        for out in outputs:
            if out.finish_reason is not None:
                trace.finish_step[out.request.request_id] = step
        if not sc.async_scheduling:  # nothing planned since: update moved no cursor
            for e in plan.seqs:
                r = sched.requests.get(e.request_id)
                if r is not None and r.status is RequestStatus.RUNNING:
                    assert r.num_computed_tokens == e.num_computed_tokens + e.num_new_tokens
        return True

    next_seq = sc.first_id + len(reqs)  # sequence ids for requests that start over
    inflight: Sent | None = None  # async scheduling: the step sent and not yet applied
    step = 0
    while pending or sched.has_work() or inflight is not None or step <= last_event:
        assert step < bound, f"no drain within {bound} steps: livelock"
        while pending and arrival[pending[0].request_id] <= step:
            sched.add_request(pending.pop(0))
        for c in sc.reconfigs:
            if c.step == step:
                if c.policy is not None:
                    policy_name = c.policy
                policy = create_policy(c.policy) if c.policy is not None else sched.policy
                sched.reconfigure(scheduler_config(sc, c.settings, policy_name), policy)
                event("reconfigure")
        abort(step, in_flight=False)
        check_pools(sched, fake)
        sent = plan_step(step) if sched.has_work() else None
        abort(step, in_flight=True)
        done, inflight = (inflight, sent) if sc.async_scheduling else (sent, None)
        if done is not None and not complete(done, inflight):
            inflight = None  # started over
        for r in sched.running:
            assert len(r.block_ids) == blocks_needed(r.num_computed_tokens, bs)
        check_pools(sched, fake)
        step += 1

    # ---- drained: no leak, the reference's tokens ----
    assert not sched.requests and not sched.running and not sched.waiting and not sched.swapped
    assert sched.pool.num_free_blocks == sc.num_blocks and sched.pool.num_used_references() == 0
    sched.pool.check_invariants()
    if sched.host_pool is not None:
        assert sched.host_pool.num_free_blocks == sc.num_host_blocks
        assert sched.host_pool.num_used_references() == 0
        sched.host_pool.check_invariants()
    assert not fake.seqs, f"the executor still holds sequences {sorted(fake.seqs)}"
    expected = reference if reference is not None else reference_outputs(fakes, sc)
    for r in reqs:
        tokens, reason = expected[r.request_id]
        if r.sampling.prompt_logprobs is not None and r.output_token_ids:  # complete before the first token
            want = [fakes.prompt_logprob(p, t) for p, t in enumerate(r.prompt_token_ids) if p > 0]
            assert [lp for lp, *_ in r.prompt_logprobs] == want, f"{r.request_id}: prompt logprobs"
            event("prompt logprobs")
        if r.request_id in trace.aborted | trace.failed:
            assert r.finish_reason is FinishReason.ABORTED
            violation(
                r.output_token_ids == tokens[: len(r.output_token_ids)],
                WrongTokens,
                f"aborted {r.request_id}: {r.output_token_ids} is not a prefix of the reference {tokens}",
            )
        else:
            violation(
                (r.output_token_ids, r.finish_reason) == (tokens, reason),
                WrongTokens,
                f"{r.request_id}: {r.output_token_ids} ({r.finish_reason}) != reference {tokens} ({reason})",
            )
    if trace.preemptions:
        event("preempted")
    return trace


# ---- the randomized test -----------------------------------------------------------------


# One run per preemption mode and prefix caching on/off, so that each is covered whatever
# the derandomized draws happen to be; everything else is drawn.
@pytest.mark.parametrize(
    "mode,churn", [("recompute", False), ("swap", False), ("swap", True)], ids=["recompute", "swap", "swap-churn"]
)
@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@RANDOMIZED
@given(data=st.data())
def test_random_scenarios_keep_every_invariant(fakes, mode, churn, caching, data):
    sc = data.draw(scenarios(mode, caching, churn), label="scenario")
    trace = simulate(fakes, sc)
    hypothesis.target(float(trace.preemptions + trace.swap_ins), label="preemptions and swap-ins")


# ---- regression tests (issue #13) ----------------------------------------------------------


def _prompt(fakes, seq_id: int, n: int) -> tuple[int, ...]:
    return tuple(fakes.make_request(seq_id, prompt_len=n).prompt_token_ids)


def test_regression_swap_in_reads_a_host_block_the_same_steps_swap_out_overwrote(fakes):
    """Issue #13, item 1. Step 2 swaps r3 out (device -> host 0). Step 3: r1 has finished, r3
    is swapped back in (host 0 -> device) and host 0 is released at once; later in the same
    schedule() r2 finds no free block, swaps itself out and is given host 0. The executor
    copies swap-outs first, so r3 reads r2's KV: r3's tokens are wrong, with no error."""
    sc = Scenario(
        block_size=4,
        num_blocks=7,
        num_host_blocks=5,
        max_model_len=4096,
        settings=Settings(max_num_batched_tokens=16, long_prefill_token_threshold=4),
        preemption_mode="swap",
        enable_prefix_caching=False,
        policy="fcfs",
        first_id=1,
        requests=(Req(0, _prompt(fakes, 1, 4), 3), Req(0, _prompt(fakes, 2, 26), 1), Req(0, _prompt(fakes, 3, 4), 12)),
    )
    trace = simulate(fakes, sc, strict=False)
    assert trace.swap_outs and trace.swap_ins, "the scenario no longer swaps: make it tighter"
    assert not trace.violations, "\n".join(trace.violations)


STREAM_STEPS = 400


def _stream(fakes) -> Scenario:
    """Issue #13, item 2: block size 4, 12 blocks (48 tokens, also max_model_len, so a prefill
    of more than 4 tokens is long), budget 16, recompute, no prefix caching, fcfs,
    max_preemptions 2. r1: 44 prompt tokens, 2 output tokens; its last step holds KV for 45
    tokens, all 12 blocks. Newer requests of 4 + 16 tokens arrive every 2 steps, steps 1..399."""
    newer = tuple(Req(step, _prompt(fakes, i, 4), 16) for i, step in enumerate(range(1, STREAM_STEPS, 2), start=2))
    return Scenario(
        block_size=4,
        num_blocks=12,
        max_model_len=48,
        settings=Settings(max_num_batched_tokens=16),
        enable_prefix_caching=False,
        preemption_mode="recompute",
        policy="fcfs",
        max_preemptions=2,
        first_id=1,
        requests=(Req(0, _prompt(fakes, 1, 44), 2),) + newer,
    )


def test_regression_the_pinned_oldest_request_is_not_preempted_again_and_finishes(fakes):
    """Issue #13, item 2. Before the fix r1, a long prefill, was planned after the decodes and
    the admissions of newer requests; short of blocks, its only candidate victim was itself,
    pinned or not: it was preempted 129 times and finished at step 537, after 54 newer
    requests, long after the stream stopped.

    What the scheduler can guarantee, and what is checked (simulate checks the first three
    after every step):
    - once pinned (2 preemptions) r1 is not preempted while another request runs; alone it
      always fits (max_model_len = the pool), so it is preempted at most twice in all;
    - no pinned request is preempted while an unpinned one keeps running;
    - once running pinned, r1 is scheduled in every step: its at most 44 prefill tokens and
      1 decode take at most 45 steps from the first step it runs pinned;
    - so it finishes while the stream still runs (before step 400).
    """
    sc = _stream(fakes)
    trace = simulate(fakes, sc, strict=False)
    done = trace.finish_step
    newer_first = sum(1 for rid, s in done.items() if rid != "r1" and s < done["r1"])
    summary = (
        f"r1 was preempted {trace.preempted['r1']} times (steps {trace.preempted_at.get('r1', [])[:6]}...), "
        f"first ran pinned at step {trace.first_pinned_step.get('r1')}, finished at step {done['r1']} "
        f"after {newer_first} newer requests; violations: {trace.violations[:3]}"
    )
    assert trace.preempted["r1"] <= sc.max_preemptions, summary
    assert not trace.violations, summary
    if "r1" in trace.first_pinned_step:
        assert done["r1"] - trace.first_pinned_step["r1"] < 45, summary
    assert done["r1"] < STREAM_STEPS, summary


# ---- regression tests (issue #32) ----------------------------------------------------------


def _decodes_left_out(sched: Scheduler, fake, steps: int) -> list[str]:
    """Runs `steps` steps, each planned after the last one's result; returns the decodes each
    left out of a step that scheduled a prefill chunk, as "step N: request"."""
    left = []
    for _ in range(steps):
        decoding = {r.request_id for r in sched.running if is_decoding(r, sched.max_model_len)}
        plan = sched.schedule()
        left += [f"step {plan.step_id}: {rid}" for rid in decodes_left_out(sched, plan, decoding, admitted=False)]
        sched.update(plan, fake.execute(plan))
    return left


def _pinned_setup(fakes, *decoding: int):
    """A scheduler (budget 8, max_preemptions 1, no prefix caching) with requests `decoding`
    (seq ids, 4-token prompts) admitted and decoding, then r1, older, with an 80-token prompt."""
    sched = fakes.make_scheduler(max_num_batched_tokens=8, max_preemptions=1, enable_prefix_caching=False)
    fake = fakes.FakeExecutor(64, 4)
    for seq_id in decoding:
        sched.add_request(fakes.make_request(seq_id, prompt_len=4, max_tokens=40))
    sched.update(plan := sched.schedule(), fake.execute(plan))
    sched.add_request(fakes.make_request(1, prompt_len=80, max_tokens=2))  # arrival 1.0: the oldest
    return sched, fake


def test_regression_a_pinned_prefill_does_not_stall_a_younger_pinned_decode(fakes):
    """Issue #32, item 6 (a). r1 (pinned, the oldest) prefills 80 tokens, r2 (pinned, younger)
    decodes. The decode reserve counted only unpinned decodes, so r1 took the whole budget of 8
    and r2 waited 9 steps in a row. Now r1 leaves r2 its token, and still gains 7 every step."""
    sched, fake = _pinned_setup(fakes, 2)
    r1, r2 = sched.requests["r1"], sched.requests["r2"]
    r1.num_preemptions = r2.num_preemptions = 1  # pinned, as after a preemption
    assert _decodes_left_out(sched, fake, 14) == []
    assert r1.num_output_tokens >= 1 and r2.num_output_tokens == 15


def test_regression_a_pinned_decode_does_not_take_an_unpinned_decodes_token(fakes):
    """Issue #32, item 6 (b). r1 (pinned, the oldest) prefills, r2 (pinned) and r3 decode. r1
    left one token, for r3 only; r2, placed after r1, took it (each pinned chunk got at least
    one), so r3 waited while r1 prefilled. Now r1 leaves a token for each decode."""
    sched, fake = _pinned_setup(fakes, 2, 3)
    r1, r2, r3 = sched.requests["r1"], sched.requests["r2"], sched.requests["r3"]
    r1.num_preemptions = r2.num_preemptions = 1
    assert _decodes_left_out(sched, fake, 16) == []
    assert r1.num_output_tokens >= 1 and r2.num_output_tokens == r3.num_output_tokens == 17


def test_regression_a_request_whose_last_token_is_in_flight_is_no_victim(fakes):
    """Issue #32, item 7 (async scheduling: each step is planned before the last one's result).
    r1 (pinned, the oldest) has its last token in flight, so scheduling skips it; r2 (pinned)
    needs a block and none is free. r1 was its victim, swapped out (all its KV copied to host)
    one step before it finished. r1 ends with that step and is no victim now."""
    sched = fakes.make_scheduler(
        num_blocks=4, block_size=2, num_host_blocks=8, max_preemptions=1, preemption_mode="swap"
    )
    fake = fakes.FakeExecutor(4, 2, num_host_blocks=8)
    r1 = fakes.make_request(1, prompt_len=2, max_tokens=2)
    r2 = fakes.make_request(2, prompt_len=3, max_tokens=6)
    for r in (r1, r2):
        r.num_preemptions = 1
        sched.add_request(r)
    inflight, preempted = None, []
    for _ in range(30):
        plan = sched.schedule() if sched.has_work() else None
        if plan is not None:
            preempted += [(plan.step_id, rid, r1.ends_by_length(sched.max_model_len)) for rid in plan.preempted]
        if inflight is not None:
            sched.update(inflight, fake.execute(inflight))
        inflight = plan
        if inflight is None and not sched.has_work():
            break
    assert "r1" not in [rid for _, rid, _ in preempted], f"preempted (step, request, r1 ending): {preempted}"
    assert r1.finish_reason is FinishReason.LENGTH and len(r1.output_token_ids) == 2
    assert r2.finish_reason is FinishReason.LENGTH and len(r2.output_token_ids) == 6
    assert sched.pool.num_free_blocks == 4 and sched.host_pool.num_free_blocks == 8 and not fake.seqs
