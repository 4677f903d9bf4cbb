"""Async scheduling (--async-scheduling): step N+1 is planned and sent while step N runs.

The fake executor (conftest.py) runs a plan only after the one it follows, checks that at
most two steps are in flight, and derives each sampled token from the KV it reads back, so a
wrong cursor, block table, swap or fed-back token changes the output or trips a check.
The suite runs 25 random workloads; a longer run:
`CHUNKSERVE_ASYNC_EXAMPLES=3000 .venv/bin/python -m pytest tests/scheduler_svc/test_async_scheduling.py`.
"""

from __future__ import annotations

import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.config import AUTO_OVERLAP_MAX_SEQS, SchedulerConfig, overlap_limit
from scheduler_svc.errors import StepFailedError
from scheduler_svc.request import FinishReason

BLOCK = 4
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'


@settings(
    max_examples=int(os.environ.get("CHUNKSERVE_ASYNC_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],  # both stateless
)
@given(
    data=st.data(),
    n=st.integers(1, 8),
    eos_after=st.sampled_from([None, 30, 50]),
    mode=st.sampled_from(["recompute", "swap"]),
    num_blocks=st.sampled_from([16, 24, 96]),
    caching=st.booleans(),
    chunked=st.booleans(),
)
def test_async_scheduling_changes_no_request_and_leaks_no_block(
    fakes, byte_tokenizer_dir, data, n, eos_after, mode, num_blocks, caching, chunked
):
    """Every request's tokens, text and finish reason are those of the same workload without
    async scheduling: EOS, stop strings (a request then computes one token more, dropped),
    max_tokens, a 64-token context, shared prefixes (prefix cache), preemption by recompute
    or swap with a victim that may be in the step in flight; aborted requests get a prefix of
    the same tokens; the same with the default (small steps overlapped, big ones not). No block,
    host block or executor sequence is left, and steps did overlap."""
    base = fakes.draw_prompts(data, n)
    cfg = dict(
        preemption_mode=mode,
        max_num_batched_tokens=data.draw(st.sampled_from([8, 16, 64]), label="budget") if chunked else 64,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        max_model_len=64,
    )

    def go(work, async_scheduling):
        fake = fakes.FakeExecutor(num_blocks, BLOCK, eos_after=eos_after, num_host_blocks=64)
        engine, results = fakes.run_workload(
            byte_tokenizer_dir, work, fake=fake, async_scheduling=async_scheduling, **cfg
        )
        sched = engine.scheduler
        assert sched.pool.num_free_blocks == num_blocks and sched.host_pool.num_free_blocks == 64
        assert not sched.requests and not fake.seqs and not engine.is_dead
        return results, fake

    # The fake's output is a function of each request's own history: probe the texts once,
    # then stop on pieces of them.
    probe, _ = go([(p, m, (), None) for p, m in base], False)
    work = fakes.draw_stops_and_aborts(data, base, [text for _, text, _, _ in probe])
    # None: the default, which overlaps only steps of at most AUTO_OVERLAP_MAX_SEQS sequences.
    (off, _), (on, fake), (auto, _) = go(work, False), go(work, True), go(work, None)
    for (_, _, _, abort), a, b, c, full in zip(work, off, on, auto, probe):
        assert a[3] is None and b[3] is None and c[3] is None  # no request failed
        if abort is None:
            assert b == a and c == a
        else:  # where an abort lands depends on when the stream is read: a prefix, then ended
            for tokens, _, reason, _ in (a, b, c):
                assert tokens == full[0][: len(tokens)] and reason is not None
    if any(len(tokens) >= 2 for tokens, *_ in probe):
        assert fake.max_in_flight == 2, "a decode could have been planned during its prefill, and was not"


def test_async_scheduling_overlaps_and_computes_one_token_more_per_eos(fakes, byte_tokenizer_dir):
    """The flag really plans ahead: the executor has two steps at once, every later step says
    which one it follows, and a request ended by EOS was also in the step after its last one
    (that token is computed and dropped); a max_tokens end is known ahead, so it costs nothing."""
    prompt = list(range(40, 60))
    rows, outs, fakes_used = {}, {}, {}
    for async_scheduling in (False, True):
        fake = fakes.FakeExecutor(96, BLOCK, eos_after=len(prompt) + 6)
        work = [(prompt, 12, (), None), (list(range(70, 80)), 5, (), None)]
        _, outs[async_scheduling] = fakes.run_workload(
            byte_tokenizer_dir, work, fake=fake, async_scheduling=async_scheduling
        )
        rows[async_scheduling] = sum(1 for plan in fake.plans for s in plan.seqs)
        fakes_used[async_scheduling] = fake
    assert outs[True] == outs[False]
    assert outs[True][0][2] is FinishReason.STOP and outs[True][1][2] is FinishReason.LENGTH
    assert rows[True] == rows[False] + 1  # the EOS request's extra decode; none for max_tokens
    on, off = fakes_used[True], fakes_used[False]
    assert on.max_in_flight == 2 and off.max_in_flight == 1
    assert all(p.follows_step_id is None for p in off.plans)
    followed = [p for p in on.plans if p.follows_step_id is not None]
    assert followed and all(p.follows_step_id < p.step_id for p in followed)


def test_by_default_a_cpu_executor_overlaps_only_small_steps(fakes, byte_tokenizer_dir):
    """Neither flag given: a step is planned on top of one in flight only where that one holds
    at most AUTO_OVERLAP_MAX_SEQS sequences; a bigger step is finished first. One request
    overlaps its decodes; five at once do not, until all but two have ended."""
    assert AUTO_OVERLAP_MAX_SEQS == 2  # the lengths below are chosen for it
    plans = {}
    for n in (1, 5):
        fake = fakes.FakeExecutor(96, BLOCK)
        work = [(list(range(40 + 3 * i, 50 + 3 * i)), 4 + 3 * i, (), None) for i in range(n)]
        engine, results = fakes.run_workload(byte_tokenizer_dir, work, fake=fake)
        assert engine.overlap_max_seqs == 2 and all(r[3] is None for r in results)
        assert [len(r[0]) for r in results] == [4 + 3 * i for i in range(n)]
        plans[n] = {p.step_id: p for p in fake.plans}
    overlapped = [p for p in plans[1].values() if p.follows_step_id is not None]
    assert len(overlapped) >= 3  # every decode after the first
    for p in plans[5].values():
        if p.follows_step_id is not None:
            assert len(plans[5][p.follows_step_id].seqs) <= 2
    big = [p for p in plans[5].values() if len(p.seqs) > 2]
    assert big and all(plans[5][p.step_id + 1].follows_step_id is None for p in big if p.step_id + 1 in plans[5])
    assert any(p.follows_step_id is not None for p in plans[5].values())  # the last two requests' decodes


def test_a_plan_with_nothing_to_send_takes_no_step_id(fakes):
    """Planning on top of a step in flight can find nothing to do (here: the request's last token
    is in flight); that plan is never sent, so the next one takes its id and the executor, the
    trace and the policies' step counts see consecutive steps."""
    sched = fakes.make_scheduler(num_blocks=64, block_size=BLOCK)
    sched.add_request(fakes.make_request(1, 8, max_tokens=2))
    first, second = sched.schedule(), sched.schedule()  # the prefill, then the decode on top of it
    assert first.seqs and second.seqs
    empty = sched.schedule()
    assert empty.is_empty and sched.num_steps == 2
    sched.add_request(fakes.make_request(2, 8, max_tokens=2))
    third = sched.schedule()
    assert [first.step_id, second.step_id, third.step_id] == [0, 1, 2] and third.seqs


@pytest.mark.parametrize(
    ("cfg", "device", "limit"),
    [
        ({}, "cpu", AUTO_OVERLAP_MAX_SEQS),
        ({}, "cuda:0", None),
        ({"async_scheduling": True}, "cpu", None),
        ({"async_scheduling": False}, "cuda", 0),
        ({"async_output_processing": True}, "cuda", 0),
        ({"speculative_config": NGRAM}, "cpu", 0),
        ({"speculative_config": NGRAM, "async_scheduling": True}, "cpu", None),
    ],
)
def test_overlap_limit(cfg, device, limit):
    """What each setting resolves to: an explicit flag wins; by default a GPU overlaps every
    step and a CPU small ones, and neither overlaps any with speculative decoding (drafts need
    the last token) or async output processing (served by the plain loop)."""
    assert overlap_limit(SchedulerConfig(**cfg), device) == limit


def test_a_failed_step_under_async_scheduling(fakes, byte_tokenizer_dir):
    """A step fails (out of memory, the executor alive) while the next one, planned on top of
    it, is in flight: the failed step's requests end with its code; the next step is refused
    (its sequences are behind there) and its other requests start over under new sequence
    ids, finishing with the tokens of an undisturbed run. Nothing leaks, nothing hangs."""
    prompts = [[(7 * i + j) % 200 for j in range(6 + 3 * i)] for i in range(10)]

    class OomOnce(fakes.FakeExecutor):
        def __init__(self):
            super().__init__(96, BLOCK, refuse_bad_plans=True)
            self.failed_step = None
            self.victim_seq = None

        def refusal(self, plan):
            # The first step with the victim decoding and another request's last prompt chunk
            # (so the step after it admits a request that is not in it).
            entry = next((s for s in plan.seqs if s.seq_id == self.victim_seq), None)
            ends_prefill = any(s.sample and s.token_ids for s in plan.seqs if s.seq_id != self.victim_seq)
            if self.failed_step is None and entry is not None and not entry.token_ids and ends_prefill:
                self.failed_step = plan.step_id
                return StepFailedError("out of memory", grpc.StatusCode.RESOURCE_EXHAUSTED)
            return None

    work = [(p, 10, (), None) for p in prompts]
    _, reference = fakes.run_workload(byte_tokenizer_dir, work, fake=fakes.FakeExecutor(96, BLOCK))
    fake = OomOnce()
    fake.victim_seq = 1  # the first request's sequence (the engine numbers them from 1)
    engine, results = fakes.run_workload(
        byte_tokenizer_dir, work, fake=fake, async_scheduling=True, max_num_batched_tokens=8
    )
    assert fake.failed_step is not None, "the workload no longer reaches the failure: adjust it"
    failed = [i for i, r in enumerate(results) if r[3] is not None]
    assert 0 in failed and all(results[i][3] is grpc.StatusCode.RESOURCE_EXHAUSTED for i in failed)
    assert len(failed) < len(results)
    for i, (got, want) in enumerate(zip(results, reference)):
        if i not in failed:
            assert got == want
    after = [p for p in fake.plans if p.step_id > fake.failed_step]
    assert any(n.seq_id > len(prompts) for p in after for n in p.new_seqs), "no request started over"
    assert not engine.is_dead and engine.scheduler.pool.num_free_blocks == 96 and not fake.seqs


@pytest.mark.slow  # two real server pairs on the tiny model
def test_async_scheduling_through_the_real_executor(tiny_model_path, tmp_path):
    """Over gRPC with the real executor (its follows_step_id ordering, its token feed-back):
    16 concurrent greedy requests of mixed lengths in a pool small enough to swap, the same
    tokens with and without async scheduling, and nothing left behind."""
    import concurrent.futures
    import urllib.request

    from chunkserve.client import build_request
    from chunkserve.launch import start_server

    prompts = [[(13 * i + 7 * j) % 900 + 5 for j in range(4 + 9 * i)] for i in range(16)]
    executor_args = ["--model", str(tiny_model_path), "--dtype", "float32", "--block-size", "16"]
    executor_args += ["--num-gpu-blocks-override", "24", "--swap-space", "0.01"]
    got = {}
    for flag in ([], ["--async-scheduling"]):
        server = start_server(
            tmp_path, executor_args, ["--max-num-batched-tokens", "32", "--preemption-mode", "swap", *flag]
        )
        try:
            stub = server.stub()

            def run(i, stub=stub):
                request = build_request(prompts[i], temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True)
                return [t for m in stub.Generate(request, timeout=120) for t in m.token_ids]

            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                got[bool(flag)] = list(pool.map(run, range(len(prompts))))
            server.assert_idle_and_no_leaks()
            metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
            swapped = [
                line for line in metrics.splitlines() if line.startswith("chunkserve_kv_blocks_swapped_out_total{")
            ]
            assert swapped and float(swapped[0].rsplit(" ", 1)[1]) > 0, "no swap: tighten the pool"
        finally:
            server.stop()
    assert [len(t) for t in got[True]] == [8 + 3 * i for i in range(16)]
    assert got[True] == got[False]
