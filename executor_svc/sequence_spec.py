"""What a NewSequence asks of the sampler, checked: its SamplingSpec from the proto (ranges,
logprob counts, penalties, logit bias, allowed tokens) and the token ids a penalty needs. Part
of the plan contract (plan_check.py), apart so the contract's file stays about the plan.
"""

from __future__ import annotations

import numpy as np

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.penalties import LogitBias, Penalties
from executor_svc.sampler import SamplingSpec

# The scheduler never asks for more (scheduler_svc/validation.py MAX_LOGPROBS; a test keeps
# the two equal): anything larger is a bad plan, and would make the response vocab-sized.
MAX_NUM_LOGPROBS = 20


def spec_from_proto(p: epb.SamplingParams) -> SamplingSpec:
    """SamplingSpec of a NewSequence; ValueError on a parameter the sampler cannot honour."""
    spec = SamplingSpec(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        seed=p.seed if p.has_seed else None,
        num_logprobs=p.num_logprobs,
        num_prompt_logprobs=p.num_prompt_logprobs - 1,
        penalties=Penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty or 1.0),
        logit_bias=LogitBias.of(dict(p.logit_bias)),
        allowed=np.unique(np.asarray(p.allowed_token_ids, dtype=np.int64)) if p.allowed_token_ids else None,
        bad_words=tuple(tuple(w.token_ids) for w in p.bad_words),
    )
    if not all(spec.bad_words):
        raise ValueError("bad_words: every word needs at least one token id")
    if max(spec.num_logprobs, spec.num_prompt_logprobs) > MAX_NUM_LOGPROBS:
        raise ValueError(f"num_logprobs and num_prompt_logprobs - 1 must be at most {MAX_NUM_LOGPROBS}")
    return spec


def check_token_ids(
    new: epb.NewSequence, spec: SamplingSpec, vocab_size: int
) -> dict[int, tuple[list[int], list[int]]]:
    """Its logit bias and bad words name tokens of the vocabulary; a sequence with a penalty or
    bad words comes with its prompt's token ids (and its output so far), one without sends none
    (a scheduler that sends them anyway has lost track of which is which). Returns {sequence:
    (prompt, output)} for one that has them."""
    bias = spec.logit_bias
    if bias is not None and (bias.ids.max() >= vocab_size or not np.isfinite(bias.values).all()):
        raise ValueError(f"logit_bias: ids inside the vocabulary (size {vocab_size}) and finite values only")
    if spec.allowed is not None and spec.allowed[-1] >= vocab_size:
        raise ValueError(f"allowed_token_ids: id {spec.allowed[-1]} is outside the vocabulary (size {vocab_size})")
    words = [t for w in spec.bad_words for t in w]
    if words and max(words) >= vocab_size:
        raise ValueError(f"bad_words: id {max(words)} is outside the vocabulary (size {vocab_size})")
    prompt, output = list(new.prompt_token_ids), list(new.output_token_ids)
    if not spec.penalties.active and not spec.bad_words:
        if prompt or output:
            raise ValueError("token ids sent with a sequence that has no penalty or bad words")
        return {}
    if not prompt:
        raise ValueError("a sequence with a penalty or bad words needs its prompt_token_ids")
    bad = next((t for t in prompt + output if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary (size {vocab_size})")
    return {new.seq_id: (prompt, output)}
