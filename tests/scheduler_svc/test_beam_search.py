"""Beam search (scheduler_svc/beam_search.py) on a stub engine whose next-token logprobs are a
table: an end-of-sequence candidate is complete and competes at the end with the live beams,
the length penalty decides between them as vLLM's score does, and a client that leaves aborts
the step requests still running. The search against transformers' on a real model is in
tests/test_openai_clients.py."""

from __future__ import annotations

import asyncio

from scheduler_svc import beam_search
from scheduler_svc.beam_search import BeamOptions
from scheduler_svc.output import RequestStream, StreamDelta, TokenLogprobs

EOS = 9
# Next-token logprobs after a sequence's last token (exact in binary, so sums compare exactly).
TABLE = {
    0: [(1, -0.125), (2, -0.5), (EOS, -1.0)],
    1: [(1, -0.125), (2, -0.5), (EOS, -1.0)],
    2: [(EOS, -0.015625), (1, -0.25), (2, -1.0)],
}


class Base:
    cache_salt, priority, tenant = "", 0, ""


class StubEngine:
    """add_request answers from TABLE at once, or never (`hang`); records aborts."""

    eos_token_ids = frozenset({EOS})

    def __init__(self, hang: bool = False) -> None:
        self.hang, self.asked, self.aborted = hang, [], []

    def add_request(self, tokens, sampling, salt, priority, tenant) -> RequestStream:
        assert sampling.max_tokens == 1 and sampling.ignore_eos and sampling.temperature == 0
        self.asked.append(list(tokens))
        stream = RequestStream(f"r{len(self.asked)}")
        if not self.hang:
            top = TABLE[tokens[-1]][: sampling.logprobs]
            lp = TokenLogprobs(top[0][1], [(t, v, "") for t, v in top])
            stream.queue.put_nowait(StreamDelta(token_ids=[top[0][0]], logprobs=[lp], finished=True))
        return stream

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def outputs(penalty: float) -> list[tuple[list[int], bool]]:
    beams = asyncio.run(beam_search.search(StubEngine(), [0], BeamOptions(2, penalty), 2, Base()))
    return [(b.output, b.ended) for b in beams]


def test_an_ended_beam_wins_by_its_sum_without_a_length_penalty():
    # Sums: [1, 1] -0.25, [2, EOS] -0.515625 (complete), [1, 2] -0.625, [2, 1] -0.75, ...
    assert outputs(0.0) == [([1, 1], False), ([2, EOS], True)]


def test_with_a_length_penalty_the_shorter_ended_beam_loses():
    # Over (tokens, EOS not counted): [1, 1] -0.25 / 3, [1, 2] -0.625 / 3, [2, EOS] -0.515625 / 2.
    assert outputs(1.0) == [([1, 1], False), ([1, 2], False)]


def test_a_client_that_leaves_aborts_the_step_requests():
    async def main():
        engine = StubEngine(hang=True)
        gone = asyncio.get_running_loop().create_future()
        gone.set_result(None)
        beams = await beam_search.run(engine, [0], BeamOptions(2), 4, Base(), gone)
        assert beams is None and engine.asked == [[0]] and engine.aborted == ["r1"]

    asyncio.run(main())
