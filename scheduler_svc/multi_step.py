"""Multi-step decoding (`--num-scheduler-steps`, vLLM's name): one plan, several decode steps.

Why: at batch 1 on a CPU, what the server does around each step (the scheduler's Python, the
gRPC hop both ways, the client's stream) costs ~1.9 ms of CPU a token on a 2-core EPYC, on
the same cores the step's threads fill, so it lengthens a ~15-20 ms step by about as much
(benchmarks/RESULTS.md, "Batch 1: what the server adds to the step"). A plan with
num_steps = k has the executor run k decode steps in a row, feeding back its own tokens
(executor.proto, StepRequest.num_steps): the planning and the plan's message are paid once for
k tokens. With --multi-step-stream-outputs (the default) the executor answers each step as it
ends and the engine streams its tokens at once (engine.py); off, a request's k tokens reach its
stream together (one message: output.py folds queued deltas).

`extend` runs once a plan holds everything else (scheduler.py). It extends only a plan of
decodes alone, and only while nothing could join the steps it delays: no request waiting or
swapped out, none preempted for this plan. k is the flag's, shrunk to what every entry's
request has left of max_tokens and of the context, and to the free blocks (it never
preempts). A request that ends earlier (EOS, a stop token or string) drops the tokens after
its end, computed for nothing, as a verify step's rejected drafts are (output.py). Entries with
a grammar (a mask per token, which needs the token before) or drafts are never extended.

A request that arrives while the k steps run is not held back by them: the engine asks the
executor to end the plan after the step under way (CutSteps), and `applied` moves cursors and
in-flight counts back over the steps it did not run (docs/architecture.md, "Multi-step
decoding"); a cancelled request cuts it too, and so does the engine once every request of a
streamed plan has ended. Under async scheduling the next plan goes out once a streamed plan's
last step is under way, when no cut can shorten it any more (engine.py, SentStep.may_follow). Greedy tokens are the same: each step is the computation a plan of its
own would run (tests/scheduler_svc/test_multi_step.py).
"""

from __future__ import annotations

from typing import Protocol

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.plan import StepPlan, StepResult
from scheduler_svc.policy import Policy
from scheduler_svc.request import Request, RequestStatus


class Scheduler(Protocol):
    """What these functions use of scheduler_svc.scheduler.Scheduler (which calls them)."""

    config: SchedulerConfig
    requests: dict[str, Request]
    waiting: list[Request]
    swapped: list[Request]
    pool: BlockPool
    policy: Policy
    max_model_len: int


def extend(sched: Scheduler, plan: StepPlan) -> None:
    """Makes a plan of decodes alone a multi-step plan where it may (module docstring); its
    entries get the blocks of the steps after the first, and `plan.num_steps` is set."""
    k = sched.config.num_scheduler_steps or 1  # None: not resolved (config.resolve_auto), one step
    if k < 2 or not plan.seqs or sched.waiting or sched.swapped or plan.preempted:
        return
    requests = []
    for entry in plan.seqs:
        if (
            entry.num_new_tokens != 1
            or not entry.sample
            or entry.draft_token_ids
            or entry.token_masks
            or entry.prompt_logprob_rows
        ):
            return
        request = sched.requests[entry.request_id]
        if request.sampling.constraint is not None:
            return
        produced = request.num_output_tokens + request.num_inflight_tokens  # before this plan's
        k = min(k, request.sampling.max_tokens - produced, sched.max_model_len - request.num_tokens)
        requests.append(request)
    while k >= 2 and sum(sched.pool.num_new_blocks(r, k) for r in requests) > sched.pool.num_free_blocks:
        k -= 1
    if k < 2:
        return
    for entry, request in zip(plan.seqs, requests):
        entry.new_block_ids.extend(sched.pool.allocate(request, k))
    plan.num_steps = k


def applied(sched: Scheduler, plan: StepPlan, result: StepResult) -> None:
    """After a multi-step plan's tokens are applied (`update`): a plan the executor cut short
    (CutSteps) moves its requests' cursors and in-flight counts back over the steps it did not
    run (their blocks stay, for the next tokens, as after rejected drafts); the policy is told
    the tokens the later steps computed (schedule() told it the first step's); the blocks the
    later steps filled are cached (a block's hash needs its token ids, known only now).
    Nothing for a plan of one step."""
    if plan.num_steps == 1:
        return
    missed = plan.num_steps - result.num_steps
    for entry in plan.seqs:
        request = sched.requests.get(entry.request_id)
        if request is None or request.seq_id != entry.seq_id or request.status is not RequestStatus.RUNNING:
            continue  # ended (or restarted) while the plan ran
        request.num_computed_tokens -= missed
        request.num_inflight_tokens -= missed
        sched.policy.on_scheduled(request, result.num_steps - 1)
        end = entry.num_computed_tokens + entry.num_new_tokens + result.num_steps - 1
        sched.pool.cache_full_blocks(request, request.cache_salt, end)
