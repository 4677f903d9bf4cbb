"""Multi-step plans (StepRequest.num_steps, the scheduler's --num-scheduler-steps) on the
executor: a plan runs, then num_steps - 1 decodes of its sequences from the tokens they
sampled, with the very tokens (and logprobs) of as many one-step plans, greedy, seeded and
penalized alike; the answer groups each sequence's tokens in step order; the plan check
covers the later steps' blocks and positions up front, so a plan it would not finish is
refused whole and changes nothing."""

from __future__ import annotations

import pytest

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.plan_check import PlanError

GREEDY = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=2)
# Seeded sampling draws by (seed, position) and the penalties count what the sequence sampled:
# a later step that fed back the wrong token, or counted it twice, changes what this draws.
SEEDED = epb.SamplingParams(
    temperature=0.9, top_p=1.0, has_seed=True, seed=11, num_logprobs=1, frequency_penalty=0.7, repetition_penalty=1.3
)
PROMPTS = {1: [3, 17, 9, 44, 23, 8, 61], 2: [5, 12, 30, 2, 7]}
SAMPLING = {1: GREEDY, 2: SEEDED}
PLAIN = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)  # greedy alone: the native loop's
TABLES = {1: list(range(0, 8)), 2: list(range(8, 16))}  # 32 slots each at block size 4


@pytest.fixture(scope="module")
def runner(tiny):
    """The runner tests' tiny random Llama (conftest.py): block size 4, 32 blocks."""
    return tiny[1].runner


def _prefill(runner, sampling: dict[int, epb.SamplingParams] = SAMPLING) -> dict[int, int]:
    """Both prompts in one step; their cursors then sit on the first sampled token."""
    runner.reset()
    plan = epb.StepRequest(step_id=1)
    for seq_id, prompt in PROMPTS.items():
        penalized = sampling[seq_id].frequency_penalty != 0
        plan.new_seqs.add(seq_id=seq_id, sampling=sampling[seq_id], prompt_token_ids=prompt if penalized else [])
        plan.seqs.add(
            seq_id=seq_id,
            num_computed_tokens=0,
            num_new_tokens=len(prompt),
            token_ids=prompt,
            block_ids=TABLES[seq_id],
            sample=True,
        )
    return {s.seq_id: s.token_id for s in runner.execute(plan).sampled}


def _decode_plan(runner, step_id: int, num_steps: int = 1) -> epb.StepRequest:
    plan = epb.StepRequest(step_id=step_id, num_steps=num_steps)
    for seq_id in PROMPTS:
        plan.seqs.add(
            seq_id=seq_id, num_computed_tokens=runner.seqs[seq_id].num_computed_tokens, num_new_tokens=1, sample=True
        )
    return plan


def _tokens(sampled) -> dict[int, list[tuple[int, float, list[tuple[int, float]]]]]:
    out: dict[int, list] = {seq_id: [] for seq_id in PROMPTS}
    for s in sampled:
        out[s.seq_id].append((s.token_id, s.logprob, [(t.token_id, t.logprob) for t in s.top]))
    return out


@pytest.mark.parametrize("num_steps", [2, 5])
def test_a_multi_step_plan_samples_what_one_step_plans_do(runner, num_steps):
    _prefill(runner)
    single = {seq_id: [] for seq_id in PROMPTS}
    for k in range(num_steps):
        for seq_id, got in _tokens(runner.execute(_decode_plan(runner, 2 + k)).sampled).items():
            single[seq_id] += got
    cursors = {seq_id: runner.seqs[seq_id].num_computed_tokens for seq_id in PROMPTS}

    _prefill(runner)
    response = runner.execute(_decode_plan(runner, 2, num_steps))
    assert [s.seq_id for s in response.sampled] == [1] * num_steps + [2] * num_steps  # grouped, step order
    assert _tokens(response.sampled) == single
    assert {seq_id: runner.seqs[seq_id].num_computed_tokens for seq_id in PROMPTS} == cursors
    assert response.num_tokens == 2 * num_steps and response.execute_ns >= response.forward_ns > 0
    # and the next plan goes on from there: it feeds back the last token of the multi-step plan
    after = _tokens(runner.execute(_decode_plan(runner, 3)).sampled)
    _prefill(runner)
    for k in range(num_steps + 1):
        last = _tokens(runner.execute(_decode_plan(runner, 2 + k)).sampled)
    assert after == last


def _state(runner):
    return {i: (s.num_computed_tokens, list(s.block_table), s.last_token) for i, s in runner.seqs.items()}, list(
        runner.holders
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: setattr(p, "num_steps", 30), "blocks cannot hold"),  # 8 blocks of 4 = 32 slots
        (lambda p: p.seqs[1].draft_token_ids.append(4), "multi-step plan takes only entries that sample"),
        (lambda p: p.seqs[0].token_masks.add(position=0, bits=b"\xff" * 32), "multi-step plan takes only"),
    ],
)
def test_a_multi_step_plan_it_cannot_finish_is_refused_whole(runner, change, message):
    _prefill(runner)
    plan = _decode_plan(runner, 2, num_steps=3)
    change(plan)
    before = _state(runner)
    with pytest.raises(PlanError, match=message):
        runner.execute(plan)
    assert _state(runner) == before


def test_a_multi_step_plan_with_a_chunk_that_does_not_sample_is_refused(runner):
    runner.reset()
    plan = epb.StepRequest(step_id=1, num_steps=2)
    plan.new_seqs.add(seq_id=1, sampling=GREEDY)
    plan.seqs.add(seq_id=1, num_computed_tokens=0, num_new_tokens=3, token_ids=PROMPTS[1][:3], block_ids=TABLES[1])
    with pytest.raises(PlanError, match="multi-step plan takes only entries that sample"):
        runner.execute(plan)
    assert not runner.seqs


def test_a_multi_step_plan_stays_inside_max_model_len(runner):
    _prefill(runner)
    plan = _decode_plan(runner, 2, num_steps=3)
    saved = runner.max_model_len
    # positions c, c + 1, c + 2: the third decode's is past a max_model_len of c + 2
    runner.max_model_len = plan.seqs[0].num_computed_tokens + 2
    try:
        with pytest.raises(PlanError, match="exceed max_model_len"):
            runner.execute(plan)
        plan.num_steps = 2
        assert len(runner.execute(plan).sampled) == 4
    finally:
        runner.max_model_len = saved


def test_a_multi_step_plan_after_a_prefill_chunk_in_the_same_plan(runner):
    """The first step may be any plan whose entries all sample: here the last prompt chunk,
    then decodes."""
    runner.reset()
    plan = epb.StepRequest(step_id=1, num_steps=4)
    plan.new_seqs.add(seq_id=1, sampling=GREEDY)
    plan.seqs.add(
        seq_id=1, num_computed_tokens=0, num_new_tokens=7, token_ids=PROMPTS[1], block_ids=TABLES[1], sample=True
    )
    multi = [s.token_id for s in runner.execute(plan).sampled]
    runner.reset()
    plan.num_steps = 1
    single = [runner.execute(plan).sampled[0].token_id]
    for k in range(3):
        c = runner.seqs[1].num_computed_tokens
        step = epb.StepRequest(step_id=2 + k)
        step.seqs.add(seq_id=1, num_computed_tokens=c, num_new_tokens=1, sample=True)
        single.append(runner.execute(step).sampled[0].token_id)
    assert multi == single


def test_cut_steps_ends_the_plan_after_the_step_under_way(runner, monkeypatch):
    """CutSteps (a gRPC thread sets cut_step_id) during the second step of five: the plan
    answers with two tokens a sequence and num_steps 2, the cursors stand after them, and the
    next plan decodes from there with the tokens one-step plans give. A cut naming another
    plan changes nothing."""
    _prefill(runner)
    single = {seq_id: [] for seq_id in PROMPTS}
    for k in range(5):
        for seq_id, got in _tokens(runner.execute(_decode_plan(runner, 2 + k)).sampled).items():
            single[seq_id] += got

    _prefill(runner)
    runner.cut_step_id = 1  # an earlier plan's: no effect
    calls = []
    timed = runner._execute_timed

    def counting(plan, *native_steps):
        calls.append(plan.step_id)
        if len(calls) == 2:
            runner.cut_step_id = 2
        return timed(plan, *native_steps)

    monkeypatch.setattr(runner, "_execute_timed", counting)
    response = runner.execute(_decode_plan(runner, 2, num_steps=5))
    assert response.num_steps == 2 and len(calls) == 2
    got = _tokens(response.sampled)
    assert {seq_id: t[:2] for seq_id, t in single.items()} == got
    rest = _tokens(runner.execute(_decode_plan(runner, 3, num_steps=3)).sampled)
    assert response.num_steps == 2 and {seq_id: t[2:] for seq_id, t in single.items()} == rest
    runner.reset()
    assert runner.cut_step_id is None


@pytest.fixture(scope="module")
def fused_runner(tiny):
    """The tiny model's executor with a plan whose 1-3 row steps and head take the native
    product, so a plainly greedy decode step runs fused, head and argmax included."""
    from executor_svc.config import ExecutorConfig
    from executor_svc.models.kernel_plan import Plan
    from executor_svc.worker import load

    path = tiny[2]
    loaded = load(
        ExecutorConfig(model=str(path), block_size=4, num_gpu_blocks_override=32, cache_dir=str(path / "cache"))
    )
    model = loaded.runner.model
    model.use_plan(Plan((1, 2, 3, 4), ("gemv", "gemv", "gemv", "mm")), Plan.of("gemv"))
    model.use_fused_decode()
    return loaded.runner


def _plain_prefill(runner) -> None:
    _prefill(runner, {seq_id: PLAIN for seq_id in PROMPTS})


class _Loops:
    """Records each native greedy call: (steps asked, steps run), None where it declined."""

    def __init__(self, runner, monkeypatch, before=None):
        self.calls, real = [], runner.model.greedy_decode

        def spy(batch, steps, cut):
            if before is not None:
                before()
            out = real(batch, steps, cut)
            self.calls.append(None if out is None else (steps, out.shape[0]))
            return out

        monkeypatch.setattr(runner.model, "greedy_decode", spy)


def test_a_plainly_greedy_multi_step_plan_runs_in_one_native_call(fused_runner, monkeypatch):
    """The same tokens and cursors as one-step plans on the Python layers (the fused path off),
    the answer grouped per sequence in step order, and the next plan goes on from there."""
    runner = fused_runner
    runner.model.use_fused_decode(False)
    _plain_prefill(runner)
    single = {seq_id: [] for seq_id in PROMPTS}
    for k in range(6):
        for seq_id, got in _tokens(runner.execute(_decode_plan(runner, 2 + k)).sampled).items():
            single[seq_id] += got
    cursors = {seq_id: runner.seqs[seq_id].num_computed_tokens for seq_id in PROMPTS}
    runner.model.use_fused_decode()

    loops = _Loops(runner, monkeypatch)
    _plain_prefill(runner)
    response = runner.execute(_decode_plan(runner, 2, num_steps=5))
    assert loops.calls == [(5, 5)]
    assert response.num_steps == 5 and response.num_tokens == 10
    assert [s.seq_id for s in response.sampled] == [1] * 5 + [2] * 5
    after = runner.execute(_decode_plan(runner, 3))  # one step: the loop with steps 1
    assert loops.calls == [(5, 5), (1, 1)] and after.num_steps == 1
    got = _tokens(response.sampled)
    for seq_id, t in _tokens(after.sampled).items():
        got[seq_id] += t
    assert got == single
    assert {seq_id: runner.seqs[seq_id].num_computed_tokens for seq_id in PROMPTS} == cursors


def test_a_cut_reaches_the_native_loop_of_its_plan(fused_runner, monkeypatch):
    """CutSteps for the plan under way, arriving as its native loop starts: one step runs, the
    cursors stand after it, and the next plan goes on with the tokens uncut plans give. A cut
    naming an earlier plan changes nothing."""
    runner = fused_runner
    _plain_prefill(runner)
    whole = _tokens(runner.execute(_decode_plan(runner, 2, num_steps=4)).sampled)

    _plain_prefill(runner)
    runner.cut_steps(1)  # an earlier plan's
    loops = _Loops(runner, monkeypatch, before=lambda: runner.cut_steps(2))
    response = runner.execute(_decode_plan(runner, 2, num_steps=4))
    assert loops.calls == [(4, 1)] and response.num_steps == 1
    rest = runner.execute(_decode_plan(runner, 3, num_steps=3))
    got = _tokens(response.sampled)
    for seq_id, t in _tokens(rest.sampled).items():
        got[seq_id] += t
    assert got == whole and loops.calls == [(4, 1), (3, 3)]


def test_rows_that_are_not_plainly_greedy_keep_the_step_by_step_path(fused_runner, monkeypatch):
    runner = fused_runner
    _prefill(runner)  # one greedy sequence with logprobs, one seeded and penalized
    loops = _Loops(runner, monkeypatch)
    response = runner.execute(_decode_plan(runner, 2, num_steps=3))
    assert loops.calls == [] and response.num_steps == 3


@pytest.mark.parametrize("fused", [False, True])
def test_a_streamed_plan_emits_its_steps_one_by_one_with_the_tokens_of_a_whole_plan(
    runner, fused_runner, monkeypatch, fused
):
    """`execute` with `emit` (StepRequest.stream_steps): each step but the last goes to emit as
    it ends, one token a sequence; the answer is the last step's tokens, with num_steps and
    the tokens of all steps; together the very tokens, logprobs and cursors of the plan
    answered whole. On the fused path every step is its own native call of one step. A cut
    made while a step is emitted (the scheduler saw its requests end) ends the plan after the
    step that follows it: an emitted step promised the plan's answer after it."""
    if fused:
        runner, prefill = fused_runner, _plain_prefill
        loops = _Loops(runner, monkeypatch)
    else:
        prefill = _prefill
    prefill(runner)
    whole = _tokens(runner.execute(_decode_plan(runner, 2, num_steps=4)).sampled)
    cursors = {seq_id: runner.seqs[seq_id].num_computed_tokens for seq_id in PROMPTS}

    prefill(runner)
    emitted = []
    response = runner.execute(_decode_plan(runner, 2, num_steps=4), emitted.append)
    assert [[s.seq_id for s in r.sampled] for r in emitted] == [[1, 2]] * 3
    assert [s.seq_id for s in response.sampled] == [1, 2] and response.num_steps == 4 and response.num_tokens == 8
    got = {seq_id: [] for seq_id in PROMPTS}
    for r in [*emitted, response]:
        for seq_id, t in _tokens(r.sampled).items():
            got[seq_id] += t
    assert got == whole
    assert {seq_id: runner.seqs[seq_id].num_computed_tokens for seq_id in PROMPTS} == cursors
    if fused:
        assert loops.calls == [(4, 4)] + [(1, 1)] * 4

    prefill(runner)
    emitted = []
    response = runner.execute(
        _decode_plan(runner, 2, num_steps=4), lambda r: (emitted.append(r), len(emitted) == 2 and runner.cut_steps(2))
    )
    assert len(emitted) == 2 and response.num_steps == 3
    rest = runner.execute(_decode_plan(runner, 3))  # goes on after the third step
    got = {seq_id: [] for seq_id in PROMPTS}
    for r in [*emitted, response, rest]:
        for seq_id, t in _tokens(r.sampled).items():
            got[seq_id] += t
    assert got == whole
