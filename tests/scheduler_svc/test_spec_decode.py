"""Speculative decoding in the scheduler (issue 34): greedy tokens with drafts equal those
without, whatever the proposer guesses, the budget, the pool (preemption by recompute or
swap), prefix caching, async scheduling, stop strings and aborts; drafts stay inside the
budget, never delay a decode or a prefill chunk, and nothing leaks.

The FakeExecutor (conftest.py) verifies drafts as the real one does: each row samples a pure
function of the KV it reads back, so a wrong cursor rollback, a block cached with rejected
KV or a draft written over another request's KV changes the tokens. `Echo` makes the text
repeat (the n-gram and suffix proposers then guess right, most drafts are accepted);
`Garbage` proposes random tokens (almost every draft rejected).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.request import FinishReason, RequestStatus
from scheduler_svc.spec.drafter import Drafter, StepTimes
from scheduler_svc.spec.proposer import SpecRequest

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 6}'


class Garbage:
    """A proposer whose guesses are random tokens (seeded per request and length)."""

    def prepare(self, req: SpecRequest, budget: int) -> int:
        return 0

    def propose(self, req: SpecRequest, k: int) -> list[int]:
        rng = random.Random(f"{req.request_id}/{len(req.output_token_ids)}")
        return [rng.randrange(97, 123) for _ in range(max(0, k))]

    def on_tokens(self, req: SpecRequest, new_tokens) -> None:
        pass

    def on_finish(self, req: SpecRequest) -> None:
        pass


def _echo(fakes, period: int):
    class Echo(fakes.FakeExecutor):
        """Repeats the token `period` back (the prompt's pattern), with a twist every 11th
        position so not every draft is right."""

        def next_token(self, history: list[int]) -> int:
            if len(history) % 11 == 0:
                return super().next_token(history)
            return history[-period] if len(history) >= period else 97

    return Echo


def _run(fakes, fake, requests, spec: str | None, proposer=None, **cfg):
    sched = fakes.make_scheduler(
        num_blocks=fake.num_blocks,
        block_size=fake.block_size,
        num_host_blocks=fake.num_host_blocks,
        speculative_config=spec,
        **cfg,
    )
    if proposer is not None:
        sched.drafter.proposer = proposer
    for r in requests:
        sched.add_request(r)
    budget_ok = []

    def check(s, plan):
        budget_ok.append(plan.num_tokens <= s.config.max_num_batched_tokens)
        drafted = [e for e in plan.seqs if e.draft_token_ids]
        if drafted:  # drafts only on a step of decodes alone
            assert all(e.num_new_tokens == 1 + len(e.draft_token_ids) for e in plan.seqs)

    out = fakes.run_to_completion(s := sched, fake, check=check)
    assert all(budget_ok)
    assert s.pool.num_free_blocks == s.pool.num_blocks, "a block leaked"
    s.pool.check_invariants()
    if s.host_pool is not None:
        assert s.host_pool.num_free_blocks == s.host_pool.num_blocks
    reasons = {r.request_id: r.finish_reason for r in requests}
    return out, reasons, s


def _requests(fakes, lens, max_tokens, period: int | None = None):
    # Every other request penalized: the FakeExecutor checks the token ids the penalties count
    reqs = [
        fakes.make_request(i + 1, n, max_tokens=m, repetition_penalty=1.0 + 0.5 * (i % 2))
        for i, (n, m) in enumerate(zip(lens, max_tokens))
    ]
    if period is not None:  # prompts with a repeating pattern for Echo to continue
        for r in reqs:
            r.prompt_token_ids = [97 + (r.seq_id * 3 + i) % period for i in range(len(r.prompt_token_ids))]
    return reqs


@settings(max_examples=200, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    max_tokens=st.lists(st.integers(1, 30), min_size=6, max_size=6),
    budget=st.integers(4, 64),
    num_blocks=st.integers(12, 60),
    block_size=st.sampled_from([1, 2, 4, 16]),
    mode=st.sampled_from(["recompute", "swap"]),
    caching=st.booleans(),
    chunked=st.booleans(),
    method=st.sampled_from(["ngram", "suffix", "garbage"]),
    echo=st.booleans(),
)
def test_greedy_tokens_equal_without_drafts(
    fakes, lens, max_tokens, budget, num_blocks, block_size, mode, caching, chunked, method, echo
):
    period = 5
    executor = _echo(fakes, period) if echo else fakes.FakeExecutor
    max_len = num_blocks * block_size
    lens = [min(n, max_len - 2) for n in lens]
    if not chunked:  # a whole prompt (after recompute: its output too) fits a step, as config.py requires
        budget = max(budget, max_len)
    cfg = dict(
        max_num_batched_tokens=budget,
        preemption_mode=mode,
        enable_prefix_caching=caching,
        enable_chunked_prefill=chunked,
    )
    host = num_blocks if mode == "swap" else 0

    def run(spec, proposer=None):
        fake = executor(num_blocks, block_size, num_host_blocks=host)
        reqs = _requests(fakes, lens, max_tokens[: len(lens)], period if echo else None)
        out, reasons, sched = _run(fakes, fake, reqs, spec, proposer, max_model_len=max_len, **cfg)
        return out, reasons, fake, sched

    plain, plain_reasons, _, _ = run(None)
    spec = SUFFIX if method == "suffix" else NGRAM
    got, reasons, fake, sched = run(spec, Garbage() if method == "garbage" else None)
    assert got == plain
    assert reasons == plain_reasons
    c = sched.drafter.counters
    assert (c.num_draft_tokens, c.num_accepted_tokens) == (fake.drafted, fake.accepted)
    assert sum(c.accepted_per_pos) == c.num_accepted_tokens


def test_drafts_are_accepted_on_repetitive_text_and_save_steps(fakes):
    """Echo's text repeats: the n-gram proposer's drafts are mostly right, and the same tokens
    take far fewer steps than without drafts."""
    period = 5

    def run(spec):
        fake = _echo(fakes, period)(64, 4)
        reqs = _requests(fakes, [20], [60], period)
        out, _, sched = _run(fakes, fake, reqs, spec, max_num_batched_tokens=64)
        return out, len(fake.plans), fake, sched

    plain, plain_steps, _, _ = run(None)
    got, steps, fake, sched = run(NGRAM)
    assert got == plain and len(got["r1"]) == 60
    assert fake.accepted > fake.drafted / 2
    assert steps < plain_steps * 0.6
    assert sched.drafter.counters.num_drafts > 0


def test_a_draft_never_passes_max_tokens_or_the_context(fakes):
    period = 5
    fake = _echo(fakes, period)(64, 4)
    reqs = _requests(fakes, [20, 20], [3, 40], period)
    out, reasons, _ = _run(fakes, fake, reqs, NGRAM, max_model_len=40, max_num_batched_tokens=64)
    assert len(out["r1"]) == 3 and reasons["r1"] is FinishReason.LENGTH
    assert len(out["r2"]) == 20 and reasons["r2"] is FinishReason.LENGTH  # 20 prompt + 20 = the context
    for plan in fake.plans:
        for e in plan.seqs:
            assert e.num_computed_tokens + e.num_new_tokens <= 40


def test_drafts_take_only_the_budget_left_after_decodes(fakes):
    """Four decoding requests and a budget of 6: every decode is in every step, and the drafts
    share the 2 tokens left."""
    period = 5
    fake = _echo(fakes, period)(64, 4)
    reqs = _requests(fakes, [8, 8, 8, 8], [12, 12, 12, 12], period)
    out, _, _ = _run(fakes, fake, reqs, NGRAM, max_num_batched_tokens=6)
    decoding_steps = [p for p in fake.plans if all(e.sample for e in p.seqs) and len(p.seqs) == 4]
    assert decoding_steps
    assert any(sum(len(e.draft_token_ids) for e in p.seqs) > 0 for p in decoding_steps)
    for p in fake.plans:
        assert p.num_tokens <= 6


def test_an_eos_among_accepted_drafts_ends_the_request_there(fakes):
    """The fake answers EOS from a length on: with drafts, tokens after the EOS are dropped."""
    fake = fakes.FakeExecutor(64, 4, eos_after=30)

    class Always:
        def prepare(self, req, budget):
            return 0

        def propose(self, req, k):  # exactly what the fake will answer: all accepted
            hist = list(req.prompt_token_ids) + list(req.output_token_ids)
            out = []
            for _ in range(k):
                out.append(fake.next_token(hist))
                hist.append(out[-1])
            return out

        def on_tokens(self, req, new):
            pass

        def on_finish(self, req):
            pass

    reqs = _requests(fakes, [20], [50])
    out, reasons, _ = _run(fakes, fake, reqs, NGRAM, Always(), max_num_batched_tokens=64)
    plain_fake = fakes.FakeExecutor(64, 4, eos_after=30)
    plain, _, _ = _run(fakes, plain_fake, _requests(fakes, [20], [50]), None, max_num_batched_tokens=64)
    assert out == plain and out["r1"][-1] == fakes.EOS and reasons["r1"] is FinishReason.STOP
    assert fake.accepted > 0


def test_a_request_with_a_verify_step_in_flight_is_not_planned_again(fakes):
    """Under async scheduling the next plan is built before the verify step's result: the
    request's cursor is not known yet, so it sits that plan out, and it is no victim."""
    period = 5
    fake = _echo(fakes, period)(64, 4)
    sched = fakes.make_scheduler(num_blocks=64, block_size=4, speculative_config=NGRAM, max_num_batched_tokens=64)
    (req,) = _requests(fakes, [20], [40], period)
    sched.add_request(req)
    while True:  # until a verify step is planned
        plan = sched.schedule()
        if any(e.draft_token_ids for e in plan.seqs):
            break
        sched.update(plan, fake.execute(plan))
    assert req.num_draft_inflight > 0 and req.status is RequestStatus.RUNNING
    nxt = sched.schedule()
    assert not nxt.seqs
    sched.update(plan, fake.execute(plan))
    assert req.num_draft_inflight == 0
    assert req.num_computed_tokens == req.num_tokens - 1


def test_step_times_forget_extrapolate_and_shrug_off_one_slow_step():
    t = StepTimes(window=4, min_seen=2, forget_after=10, retry_verify_after=10)
    t.observe(1, False, 0.010, step=1)
    assert t.plain(1, 2) == pytest.approx(0.010)
    assert t.plain(4, 2) == pytest.approx(0.040)  # scaled from 1 row: no faster than linear
    assert t.verify(4, 2) is None
    t.observe(4, True, 0.500, step=3)  # a first call's one-off cost: not believed alone
    assert t.verify(4, 3) is None
    t.observe(4, True, 0.012, step=4)
    t.observe(4, True, 0.014, step=5)
    assert t.verify(4, 5) == pytest.approx(0.014)  # the median: the outlier does not decide
    assert t.verify(4, 20) is None  # not seen for more than forget_after steps


def test_a_verify_figure_from_a_bad_moment_is_retried_and_a_first_call_is_outvoted():
    t = StepTimes()  # the drafter's own settings
    t.observe(1, False, 0.010, step=1)
    t.observe(9, True, 0.500, step=2)  # a first call
    t.observe(9, True, 0.020, step=3)
    assert t.verify(9, 3) is None  # two seen: not believed yet
    t.observe(9, True, 0.021, step=4)
    assert t.verify(9, 4) == pytest.approx(0.021)  # the median of three outvotes the first call
    for step in range(5, 5 + 8):  # a loaded moment: every verify of 9 rows slow
        t.observe(9, True, 0.200, step=step)
    assert t.verify(9, 13) == pytest.approx(0.200)
    for step in range(13, 200):  # plain steps only (the gate said no); the plain figure stays
        t.observe(1, False, 0.010, step=step)
    assert t.verify(9, 200) is None  # not seen for retry_verify_after steps: tried again
    t.observe(9, True, 0.020, step=201)  # ... and the old slow figures are gone with it
    t.observe(9, True, 0.020, step=202)
    t.observe(9, True, 0.020, step=203)
    assert t.verify(9, 203) == pytest.approx(0.020) and t.plain(1, 203) == pytest.approx(0.010)


def test_the_gate_drafts_only_while_it_pays():
    from scheduler_svc.spec.config import parse_speculative_config
    from scheduler_svc.spec.drafter import DraftCandidate

    d = Drafter(parse_speculative_config(NGRAM))
    cands = [DraftCandidate(0, [1, 2, 3, 4], 0.9)]
    assert d.choose(1, cands, 64, step=1) == {}  # no plain step seen: nothing to compare with
    d.times.observe(1, False, 0.010, 1)
    assert d.choose(1, cands, 64, step=2) == {0: 4}  # verify steps unseen: tried
    for rows in (2, 3, 4, 5):  # a verify of up to 4 drafts costs 5 plain steps: never pays
        for _ in range(3):
            d.times.observe(rows, True, 0.050, 2)
    assert d.choose(1, cands, 64, step=3) == {}
    for _ in range(20):  # 2 drafts turn out nearly free (the average moves there): pays at 0.9
        d.times.observe(3, True, 0.011, 3)
    assert d.choose(1, cands, 64, step=4) == {0: 2}
    assert d.choose(1, [DraftCandidate(0, [1, 2, 3, 4], 0.01)], 64, step=4) == {}
    for _ in range(20):
        d.times.observe(2, True, 0.0105, 4)
    assert d.choose(1, cands, 1, step=5) == {0: 1}  # the budget left caps it


@settings(max_examples=25, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), n=st.integers(1, 5), mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans())
def test_through_the_engine_with_stop_strings_aborts_and_async_scheduling(
    fakes, byte_tokenizer_dir, data, n, mode, caching
):
    """Tokens, text and finish reasons with drafts (sync and async scheduling) equal the run
    without; an aborted request gets a prefix; nothing is left behind."""
    period = 4
    base = [
        (
            [97 + (i + j) % period for j in range(data.draw(st.integers(1, 30), label="prompt_len"))],
            data.draw(st.integers(1, 24), label="max_tokens"),
        )
        for i in range(n)
    ]
    cfg = dict(
        preemption_mode=mode,
        max_num_batched_tokens=data.draw(st.sampled_from([8, 16, 64]), label="budget"),
        enable_prefix_caching=caching,
        max_model_len=64,
    )
    num_blocks = data.draw(st.integers(8, 40), label="num_blocks")

    def go(work, spec, async_scheduling):
        fake = _echo(fakes, period)(num_blocks, 4, num_host_blocks=64)
        engine, results = fakes.run_workload(
            byte_tokenizer_dir, work, fake=fake, speculative_config=spec, async_scheduling=async_scheduling, **cfg
        )
        sched = engine.scheduler
        assert sched.pool.num_free_blocks == num_blocks and sched.host_pool.num_free_blocks == 64
        assert not sched.requests and not fake.seqs and not engine.is_dead
        if spec is not None:
            assert len(sched.drafter.proposer) == 0  # no request's state stays with the proposer
        return results

    probe = go([(p, m, (), None) for p, m in base], None, False)
    work = fakes.draw_stops_and_aborts(data, base, [text for _, text, _, _ in probe])
    reference = go(work, None, False)
    for async_scheduling in (False, True):
        got = go(work, NGRAM, async_scheduling)
        for (_, _, _, abort), a, b, full in zip(work, reference, got, probe):
            assert b[3] is None
            if abort is None:
                assert b == a
            else:
                assert b[0] == full[0][: len(b[0])] and b[2] is not None


def test_usage_counts_no_token_after_a_stop_string(fakes, byte_tokenizer_dir):
    """A stop string completed by an accepted draft ends the request there: the tokens the
    verify step gave after it are neither streamed nor counted in usage."""
    import asyncio

    from scheduler_svc.engine import Engine
    from scheduler_svc.output import collect
    from scheduler_svc.request import SamplingParams
    from scheduler_svc.tokenizer import Tokenizer

    period = 4

    async def main(spec):
        fake = _echo(fakes, period)(64, 4)
        sched = fakes.make_scheduler(num_blocks=64, block_size=4, speculative_config=spec, max_num_batched_tokens=64)
        engine = Engine(sched, fake, Tokenizer(byte_tokenizer_dir), frozenset({fakes.EOS}), 100, 5.0)
        engine.start()
        prompt = [97 + j % period for j in range(24)]
        stream = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=("dab",)))
        whole = await asyncio.wait_for(collect(stream), 60)
        await engine.stop()
        return whole, fake

    plain, _ = asyncio.run(main(None))
    got, fake = asyncio.run(main(NGRAM))
    assert fake.accepted > 0
    assert plain.finish_reason is FinishReason.STOP_SEQUENCE
    assert (got.token_ids, got.text, got.completion_tokens) == (plain.token_ids, plain.text, plain.completion_tokens)
    assert got.completion_tokens == len(got.token_ids)


def test_metrics_and_step_trace_count_drafts_and_accepted_tokens(fakes, byte_tokenizer_dir, tmp_path):
    import asyncio
    import json

    from scheduler_svc.engine import Engine
    from scheduler_svc.metrics import Metrics
    from scheduler_svc.output import collect
    from scheduler_svc.request import SamplingParams
    from scheduler_svc.tokenizer import Tokenizer
    from scheduler_svc.trace import StepTracer

    period = 4
    fake = _echo(fakes, period)(64, 4)
    metrics, trace = Metrics("m"), StepTracer(str(tmp_path / "trace.jsonl"))

    async def main():
        sched = fakes.make_scheduler(num_blocks=64, block_size=4, speculative_config=NGRAM, max_num_batched_tokens=64)
        engine = Engine(
            sched, fake, Tokenizer(byte_tokenizer_dir), frozenset({fakes.EOS}), 100, 5.0, observers=(metrics, trace)
        )
        engine.start()
        stream = engine.add_request(
            [97 + j % period for j in range(24)], SamplingParams(temperature=0.0, max_tokens=40)
        )
        await asyncio.wait_for(collect(stream), 60)
        await engine.stop()

    asyncio.run(main())
    trace.close()
    value = lambda name, **labels: metrics.registry.get_sample_value(name, {"model_name": "m", **labels})  # noqa: E731
    assert value("chunkserve_spec_decode_num_draft_tokens_total") == fake.drafted > 0
    assert value("chunkserve_spec_decode_num_accepted_tokens_total") == fake.accepted > 0
    assert value("chunkserve_spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    steps = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert sum(s.get("numDraftTokens", 0) for s in steps) == fake.drafted
    assert sum(s.get("numAcceptedTokens", 0) for s in steps) == fake.accepted
    assert value("chunkserve_spec_decode_num_drafts_total") == sum(
        1 for s in steps for e in s["seqs"] if e.get("numDraftTokens")
    )


def test_drafts_of_several_requests_share_the_last_free_blocks_without_overdrawing(fakes):
    """Two decodes that each see room for drafts in the one free block, which only one can
    take: the second drafts only within its own blocks, and no block is taken twice."""
    period = 5
    fake = _echo(fakes, period)(5, 4)  # two 7-token prompts hold 4 of the 5 blocks
    sched = fakes.make_scheduler(num_blocks=5, block_size=4, speculative_config=NGRAM, max_num_batched_tokens=64)
    sched.drafter.times.observe(2, False, 0.01, 0)  # a plain 2-row step seen: drafting may start at once
    reqs = _requests(fakes, [7, 7], [20, 20], period)
    for r in reqs:
        sched.add_request(r)
    plan = sched.schedule()  # the two prefills
    assert len(plan.seqs) == 2
    sched.update(plan, fake.execute(plan))
    plan = sched.schedule()
    assert [len(e.draft_token_ids) for e in plan.seqs] == [4, 0]  # the first took the free block
    assert sched.pool.num_free_blocks == 0
    sched.pool.check_invariants()
    sched.update(plan, fake.execute(plan))


def test_nobody_proposes_while_no_draft_could_pay():
    """Verify steps known to cost more per token than plain ones even at full acceptance: the
    proposers are not asked (their per-request cost is saved), and an unseen bucket asks them."""
    from scheduler_svc.spec.config import parse_speculative_config

    d = Drafter(parse_speculative_config(NGRAM))
    assert not d.could_pay(4, 8, step=1)  # no plain step seen yet
    d.times.observe(4, False, 0.010, 1)
    assert d.could_pay(4, 8, step=2)  # verify steps unseen: worth a try
    seen = d.times.min_seen
    for rows in range(5, 13):
        for _ in range(seen):
            d.times.observe(rows, True, 0.010 * rows, 2)  # as slow per row as 4 plain steps
    assert not d.could_pay(4, 8, step=3)
    for _ in range(seen):
        d.times.observe(13, True, 0.011, 3)
    assert d.could_pay(4, 9, step=4)
