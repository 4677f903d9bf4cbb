"""Prompt logprobs on the executor: the rows a plan names report the logprob of the token after
them (the chunk's next token, or next_token_id after its last row) with top alternatives,
equal to transformers' log-softmax over the whole prompt, across chunks; the plan check
refuses rows it cannot compute."""

from __future__ import annotations

import pytest
import torch

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.plan_check import PlanError
from tests.executor_svc.test_runner import entry

PROMPT = [5, 9, 5, 17, 5, 30, 9, 2, 44, 5, 71, 3]


def _sampling(k: int) -> epb.SamplingParams:
    return epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1, num_prompt_logprobs=k + 1)


def _entry(computed, n, tokens, blocks=(), sample=False, **fields):
    """Sequence 1's entry (test_runner.entry) with prompt logprob fields."""
    out = entry(1, computed, n, tokens, blocks, sample)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def test_prompt_logprobs_across_chunks_equal_transformers(tiny):
    hf, loaded, _ = tiny
    runner = loaded.runner
    runner.reset()
    with torch.inference_mode():
        want = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), -1)
    # chunk 1: rows 0..4 (positions 1..5; its last row needs the token after it), no sample;
    # chunk 2: rows 0..5 (positions 6..11), its last row samples and reports nothing
    r1 = runner.execute(
        epb.StepRequest(
            step_id=1,
            new_seqs=[epb.NewSequence(seq_id=1, sampling=_sampling(3))],
            seqs=[
                _entry(0, 5, PROMPT[:5], [0, 1], prompt_logprob_first=0, prompt_logprob_rows=5, next_token_id=PROMPT[5])
            ],
        )
    )
    r2 = runner.execute(
        epb.StepRequest(
            step_id=2,
            seqs=[_entry(5, 7, PROMPT[5:], [2, 3], sample=True, prompt_logprob_first=0, prompt_logprob_rows=6)],
        )
    )
    got = list(r1.prompt_logprobs) + list(r2.prompt_logprobs)
    assert [p.position for p in got] == list(range(1, len(PROMPT)))
    assert [p.token_id for p in got] == PROMPT[1:]
    for p in got:
        row = want[p.position - 1]
        assert p.logprob == pytest.approx(row[p.token_id].item(), abs=1e-5)
        assert [t.token_id for t in p.top] == row.topk(3).indices.tolist()
    assert len(r2.sampled) == 1  # the sampling row still samples


@pytest.mark.parametrize(
    ("fields", "sampling", "message"),
    [
        (dict(prompt_logprob_rows=2), _sampling(-1), "without num_prompt_logprobs"),
        (dict(prompt_logprob_first=2, prompt_logprob_rows=2), _sampling(0), "not rows of its chunk"),
        (dict(prompt_logprob_rows=3), _sampling(0), "needs next_token_id"),
        (dict(prompt_logprob_rows=3, next_token_id=500), _sampling(0), "needs next_token_id"),
        (dict(prompt_logprob_rows=1), epb.SamplingParams(top_p=1.0, num_prompt_logprobs=22), "at most 20"),
    ],
)
def test_the_plan_check_refuses_prompt_logprob_rows_it_cannot_compute(tiny, fields, sampling, message):
    runner = tiny[1].runner
    runner.reset()
    plan = epb.StepRequest(
        step_id=1,
        new_seqs=[epb.NewSequence(seq_id=1, sampling=sampling)],
        seqs=[_entry(0, 3, PROMPT[:3], [0], **fields)],
    )
    with pytest.raises(PlanError, match=message):
        runner.execute(plan)
    assert not runner.seqs
