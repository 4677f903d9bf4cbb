"""Fakes for scheduler tests: an executor that checks every plan, its handshake, a client
standing in for ExecutorClient, and a byte-level tokenizer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from pathlib import Path

import grpc
import pytest

from chunkserve.launch import write_byte_tokenizer
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from scheduler_svc.block_pool import BlockPool, blocks_needed
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.errors import StepFailedError
from scheduler_svc.plan import PromptLogprob, Sampled, ScheduledSeq, StepPlan, StepResult
from scheduler_svc.policy import create_policy
from scheduler_svc.request import Request, SamplingParams
from scheduler_svc.scheduler import Scheduler

VOCAB = 300  # 256 byte tokens, <eos> = 256, the rest unused
EOS = 256


def prompt_logprob(position: int, token: int) -> float:
    """The FakeExecutor's logprob of the prompt token `token` at `position`."""
    return -(position + token / 1000)


class FakeExecutor:
    """Plays the executor: keeps per-sequence state and simulated KV contents, checks plans.

    Each KV slot holds the token id written there, copied by swaps like real KV. A sampled
    token is a pure function of the token history READ BACK FROM THE SEQUENCE'S BLOCKS, so
    a request's output does not depend on chunking, batching or preemption — unless the
    scheduler gets block tables, swaps or token ids wrong, which changes the output or
    trips an assertion here.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        eos_after: int | None = None,
        num_host_blocks: int = 0,
        refuse_bad_plans: bool = False,
    ) -> None:
        """refuse_bad_plans: a plan naming an unknown sequence or a wrong cursor is refused
        whole (StepFailedError, INVALID_ARGUMENT) as the real executor's validation does,
        instead of tripping an assertion: for tests of steps planned on a failed one."""
        self.refuse_bad_plans = refuse_bad_plans
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.seqs: dict[int, dict] = {}
        self.plans: list[StepPlan] = []
        self.eos_after = eos_after
        self.seq_of: dict[str, int] = {}  # request id -> seq id, as seen in plans
        # step() runs a plan only after the one it follows (async scheduling), as the real
        # executor does; it checks that at most two steps are in flight, the second one
        # following the first.
        self._handled: dict[int, asyncio.Event] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.drafted = 0  # draft tokens verified, and of those accepted (speculative decoding)
        self.prompts: dict[int, tuple[int, ...]] = {}  # seq id -> the prompt its first NewSeq sent
        self.penalized_news = 0  # NewSeqs of penalized sequences (with their tokens)
        self.accepted = 0
        # CutSteps: the step ids asked to end early, and how many steps a cut plan runs
        # (at least 1; a plan cut after it ran whole is not affected, as on the real executor).
        self.cuts: list[int] = []
        self.steps_when_cut = lambda plan: 1
        self.streamed_steps = 0  # steps of multi-step plans answered before their last (stream_steps)

    def cut_steps(self, step_id: int) -> None:
        self.cuts.append(step_id)

    def execute(self, plan: StepPlan, ran: int | None = None) -> StepResult:
        """Runs a plan; a multi-step plan runs `ran` of its steps (default all)."""
        steps = self.run_steps(plan, ran)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def run_steps(
        self, plan: StepPlan, ran: int | None = None, on_step: Callable[[StepResult], None] | None = None
    ) -> Generator[None, None, StepResult]:
        """`execute`, pausing (a yield) after each answer it gives `on_step`: with `on_step` (a
        plan with stream_steps) each step but the last goes to it as it ends, as on the real
        executor (ModelRunner.execute); a cut then ends the plan after the step under way, and
        the result holds the last step's tokens."""
        self.plans.append(plan)
        if plan.num_steps == 1:
            return self._execute_one(plan, 0)
        # Multi-step (executor_svc/runner.py): the plan, then num_steps - 1 plans of one decode
        # per entry, each feeding back the token sampled last; each sequence's tokens together.
        for s in plan.seqs:
            assert s.sample and not s.draft_token_ids and not s.token_masks and not s.prompt_logprob_rows, (
                "a multi-step plan's entry that does not only sample"
            )
        more = plan.num_steps - 1
        steps = [self._execute_one(plan, more)]
        ran, cut_before = plan.num_steps if ran is None else ran, plan.step_id in self.cuts
        for j in range(1, ran):
            if on_step is not None:
                if not cut_before and plan.step_id in self.cuts:  # asked once a step's tokens were seen
                    break
                on_step(StepResult(plan.step_id, list(steps[-1].sampled), execute_ns=steps[-1].execute_ns))
                self.streamed_steps += 1
                yield  # the scheduler reads that answer while the next step runs
            decodes = [
                ScheduledSeq(s.seq_id, s.request_id, s.num_computed_tokens + s.num_new_tokens + j - 1, 1, [], [], True)
                for s in plan.seqs
            ]
            steps.append(self._execute_one(StepPlan(plan.step_id, decodes), more - j))
        ran = len(steps)
        for s in plan.seqs:  # cut: the blocks of the steps not run stay with the sequence
            self.seqs[s.seq_id]["rolled_back"] = self.seqs[s.seq_id].get("rolled_back") or ran < plan.num_steps
        if on_step is not None:
            sampled = list(steps[-1].sampled)
        else:
            sampled = [r.sampled[i] for i in range(len(plan.seqs)) for r in steps]
        return StepResult(
            plan.step_id, sampled, steps[0].prompt_logprobs, execute_ns=steps[0].execute_ns, num_steps=ran
        )

    def _execute_one(self, plan: StepPlan, more: int) -> StepResult:
        """One step; `more` decodes of a multi-step plan follow it (its blocks are there already)."""
        bs = self.block_size
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            assert new.seq_id not in self.seqs, "new sequence the executor already knows"
            self.seqs[new.seq_id] = {"computed": None, "blocks": [], "last": None}
            self._penalty_history(new)
        swapped_out = set()
        for d, h in plan.swap_out:
            assert 0 <= d < self.num_blocks and 0 <= h < self.num_host_blocks
            self.host[h] = list(self.device.get(d, [None] * bs))
            swapped_out.add(d)
        for rid in plan.preempted:  # a preempted sequence the executor still knows was swapped
            st = self.seqs.get(self.seq_of.get(rid, -1))
            if st is not None:
                assert set(st["blocks"]) <= swapped_out, "swapped without all its blocks"
                st["blocks"], st["swapped"] = [], True  # its device table is void
        for h, d in plan.swap_in:
            assert 0 <= d < self.num_blocks and 0 <= h < self.num_host_blocks
            self.device[d] = list(self.host[h])
        sampled, prompt_logprobs = [], []
        for s in plan.seqs:
            self.seq_of[s.request_id] = s.seq_id
            st = self.seqs[s.seq_id]
            if st["computed"] is None:  # first entry: may start after a prefix-cache hit
                st["computed"] = s.num_computed_tokens
            assert s.num_computed_tokens == st["computed"], "cursor mismatch"
            draft = list(s.draft_token_ids)
            if s.token_ids:
                assert len(s.token_ids) + len(draft) == s.num_new_tokens
                new_tokens = list(s.token_ids) + draft
            else:
                assert s.num_new_tokens == 1 + len(draft) and st["last"] is not None, "decode without a known token"
                new_tokens = [st["last"]] + draft
            assert not draft or s.sample, "drafts on an entry that does not sample"
            assert s.replace_block_table or not st.get("swapped"), "resumed without a new block table"
            st["swapped"] = False
            st["blocks"] = list(s.new_block_ids) if s.replace_block_table else st["blocks"] + s.new_block_ids
            total = st["computed"] + s.num_new_tokens
            # Exactly the blocks the tokens need; after rejected drafts the blocks their slots
            # took stay with the sequence (rollback keeps them for its next tokens).
            need = blocks_needed(total + more, bs)
            assert len(st["blocks"]) == need or (st.get("rolled_back") and len(st["blocks"]) > need), "blocks != tokens"
            assert all(0 <= b < self.num_blocks for b in st["blocks"])
            others = {b for sid, o in self.seqs.items() if sid != s.seq_id for b in o["blocks"]}
            for i, tok in enumerate(new_tokens):
                pos = st["computed"] + i
                block = st["blocks"][pos // bs]
                assert block not in others, "a sequence writes into a block another one holds"
                self.device.setdefault(block, [None] * bs)[pos % bs] = tok
            st["computed"] = total
            prompt_logprobs += self._prompt_logprobs(s, st, new_tokens)
            if s.sample:
                history = [self.device[st["blocks"][p // bs]][p % bs] for p in range(total)]
                assert None not in history, "a sequence reads KV that was never written"
                if "tokens" in st:  # penalized: what the penalties count is what the KV holds
                    assert st["tokens"] == history[: total - len(draft)], "penalty token history is wrong"
                # A verify entry (drafts): row j samples after the history up to its own
                # position; keep the drafts that match, then the token after them, and move
                # the cursor back over the rest, as executor_svc/runner.py does.
                kept = 0
                while True:
                    tok = self.sample_row(s, kept, history[: total - len(draft) + kept])
                    sampled.append(Sampled(s.seq_id, tok))
                    if kept == len(draft) or tok != draft[kept]:
                        break
                    kept += 1
                st["computed"] = total - (len(draft) - kept)
                if "tokens" in st:
                    st["tokens"] += draft[:kept] + [tok]
                st["rolled_back"] = st.get("rolled_back") or kept < len(draft)
                st["last"] = tok
                self.drafted += len(draft)
                self.accepted += kept
        return StepResult(plan.step_id, sampled, prompt_logprobs, execute_ns=self.step_ns(plan))

    def _prompt_logprobs(self, s: ScheduledSeq, st: dict, new_tokens: list[int]) -> list[PromptLogprob]:
        """Prompt logprobs of an entry's rows as the executor reports them: the logprob of the
        token at position p is prompt_logprob(p, token), the token read back from this chunk's
        KV, or next_token_id for the last row, which the next chunk's first token must equal."""
        if (expected := st.pop("next", None)) is not None and s.num_computed_tokens == expected[0]:
            assert new_tokens[0] == expected[1], "next_token_id was not the token after the chunk"
        out = []
        for j in range(s.prompt_logprob_first, s.prompt_logprob_first + s.prompt_logprob_rows):
            position = s.num_computed_tokens + j + 1
            if j + 1 < len(new_tokens):
                token = new_tokens[j + 1]
            else:
                assert s.next_token_id is not None, "the last row's prompt logprob without next_token_id"
                token = s.next_token_id
                st["next"] = (position, token)
            out.append(PromptLogprob(s.seq_id, position, token, prompt_logprob(position, token), rank=1 + token % 5))
        return out

    def _penalty_history(self, new) -> None:
        """A penalized sequence comes with its tokens (the prompt, and the output so far after a
        recompute), as executor_svc/penalties.py needs; one without a penalty with none. A
        recompute sends the same prompt (the split between prompt and output stays)."""
        if not new.sampling.needs_tokens:
            assert not new.prompt_token_ids and not new.output_token_ids, "token ids without a penalty"
            return
        assert new.prompt_token_ids, "a penalized sequence without its prompt"
        st = self.seqs[new.seq_id]
        st["tokens"] = list(new.prompt_token_ids) + list(new.output_token_ids)
        prompt = tuple(new.prompt_token_ids)
        assert self.prompts.setdefault(new.seq_id, prompt) == prompt, "a recompute moved the prompt/output split"
        self.penalized_news += 1

    def step_ns(self, plan: StepPlan) -> int:
        """The step's executor time as reported: a deterministic function of its rows (no
        clock), flat up to 8 rows as a weight-bound CPU step is, so the drafting gate has a
        curve to learn. Override to model another machine."""
        return 10_000_000 + 1_000_000 * max(0, plan.num_tokens - 8)

    def sample_row(self, entry: ScheduledSeq, row: int, history: list[int]) -> int:
        """The token sampled at an entry's row `row` of its sampled rows (0: after its last
        input token without drafts, j: after its first j drafts), `history` what it reads."""
        return self.next_token(history)

    def next_token(self, history: list[int]) -> int:
        if self.eos_after is not None and len(history) >= self.eos_after:
            return EOS
        return 97 + (sum(h * (i + 1) for i, h in enumerate(history)) * 31 + len(history)) % 26

    def refusal(self, plan: StepPlan) -> StepFailedError | None:
        """Override to fail a step (in its turn, changing nothing) with the error returned."""
        return None

    def _consistent(self, plan: StepPlan) -> bool:
        dropped, new = set(plan.finished_seq_ids), {n.seq_id for n in plan.new_seqs}
        for s in plan.seqs:
            st = None if s.seq_id in dropped else self.seqs.get(s.seq_id)
            if s.seq_id in new:
                continue
            if st is None or st["computed"] not in (None, s.num_computed_tokens):
                return False
            if not s.token_ids and st["last"] is None:
                return False
        return True

    async def step(
        self, plan: StepPlan, timeout: float, on_step: Callable[[StepResult], None] | None = None
    ) -> StepResult:
        assert (on_step is not None) == plan.stream_steps, "on_step goes with a plan that streams its steps"
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        assert self.in_flight == 1 or (plan.follows_step_id is not None and self.in_flight == 2), (
            f"step {plan.step_id} sent with {self.in_flight - 1} in flight, following {plan.follows_step_id}"
        )
        try:
            await asyncio.sleep(0.001)  # a real step awaits the network: let other tasks run
            if plan.follows_step_id is not None:
                await self._handled.setdefault(plan.follows_step_id, asyncio.Event()).wait()
            refusal = self.refusal(plan)
            if refusal is not None:
                raise refusal
            if self.refuse_bad_plans and not self._consistent(plan):
                raise StepFailedError(f"step {plan.step_id} refused", grpc.StatusCode.INVALID_ARGUMENT)
            ran = None  # all of a multi-step plan's steps, unless it was cut before it started
            if plan.step_id in self.cuts and plan.num_steps > 1:
                ran = min(plan.num_steps, max(1, self.steps_when_cut(plan)))
            if on_step is None:
                return self.execute(plan, ran)
            steps = self.run_steps(plan, ran, on_step)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value
                await asyncio.sleep(0)
        finally:
            self.in_flight -= 1
            self._handled.setdefault(plan.step_id, asyncio.Event()).set()


def fake_handshake(model_path="", **overrides) -> epb.HandshakeResponse:
    """An executor's handshake: VOCAB token ids with <eos> = EOS, a 2048-token context and step
    budget, 64 KV blocks x 16 tokens, no swap space. `overrides` replace any field, the model's
    (vocab_size, max_position_embeddings, eos_token_ids) included."""
    model_fields = epb.ModelConfig.DESCRIPTOR.fields_by_name
    model = dict(vocab_size=VOCAB, max_position_embeddings=2048, eos_token_ids=[EOS])
    model |= {name: overrides.pop(name) for name in list(overrides) if name in model_fields}
    values = dict(
        model_name="fake",
        dtype="float32",
        device="cpu",
        attention_backend="fake",
        max_num_batched_tokens=2048,
        block_size=16,
        num_device_blocks=64,
        num_host_blocks=0,
    )
    return epb.HandshakeResponse(model=epb.ModelConfig(**model), model_path=str(model_path), **values | overrides)


class FakeExecutorClient:
    """Stands in for ExecutorClient. handshake() answers `hs` (assign another to change what the
    next handshake says) once `ready` is set, as it starts; step() runs plans on `fake`, a
    FakeExecutor (None: handshake only). Steps after the first `hold_after` set `held` and wait
    for `release`, then run, or for `die`, then raise as a lost executor does and hold no more."""

    def __init__(self, hs: epb.HandshakeResponse, fake: FakeExecutor | None = None) -> None:
        self.hs, self.fake = hs, fake
        self.ready = asyncio.Event()
        self.ready.set()
        self.hold_after: int | None = None
        self.held = asyncio.Event()  # set when a step is waiting for `release` or `die`
        self.release = asyncio.Event()
        self.die = asyncio.Event()
        self.handshakes = 0
        self.steps = 0

    async def handshake(self, timeout: float) -> epb.HandshakeResponse:
        await self.ready.wait()
        self.handshakes += 1
        return self.hs

    async def step(
        self, plan: StepPlan, timeout: float, on_step: Callable[[StepResult], None] | None = None
    ) -> StepResult:
        self.steps += 1
        if self.hold_after is not None and self.steps > self.hold_after:
            self.held.set()
            waits = [asyncio.ensure_future(event.wait()) for event in (self.release, self.die)]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if self.die.is_set():
                self.hold_after = None
                raise ConnectionError("the executor process died")
        return await self.fake.step(plan, timeout, on_step)

    def cut_steps(self, step_id: int) -> None:
        self.fake.cut_steps(step_id)

    async def reset(self, timeout: float = 10.0) -> None:
        if self.fake is not None:
            self.fake.seqs.clear()

    async def close(self) -> None:
        pass


def make_scheduler(num_blocks=64, block_size=4, max_model_len=4096, num_host_blocks=0, **cfg) -> Scheduler:
    config = SchedulerConfig(**cfg)
    host = BlockPool(num_host_blocks, block_size) if num_host_blocks else None
    pool = BlockPool(num_blocks, block_size, enable_caching=config.enable_prefix_caching)
    return Scheduler(config, pool, create_policy(config.scheduling_policy), max_model_len, host)


def make_request(seq_id: int, prompt_len: int, max_tokens: int = 8, **sampling) -> Request:
    prompt = [(seq_id * 13 + i) % 200 for i in range(prompt_len)]
    return Request(
        request_id=f"r{seq_id}",
        seq_id=seq_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling),
        eos_token_ids=frozenset({EOS}),
        arrival_time=float(seq_id),
    )


def run_to_completion(sched: Scheduler, fake: FakeExecutor, max_steps: int = 10_000, check=None):
    """Steps until idle; returns {request_id: output ids} and the plans."""
    outputs: dict[str, list[int]] = {}
    live = dict(sched.requests)
    for _ in range(max_steps):
        if not sched.has_work():
            break
        plan = sched.schedule()
        if check:
            check(sched, plan)
        sched.update(plan, fake.execute(plan))
    else:
        raise AssertionError("did not finish")
    for rid, req in live.items():
        outputs[rid] = list(req.output_token_ids)
    return outputs


def run_workload(tokenizer_dir: Path, work, *, fake: FakeExecutor, **cfg):
    """Runs `work` (prompt, max_tokens, stop strings, abort after k deltas or None) through an
    Engine on `fake` (scheduler settings `cfg`, the fake's pool); returns the engine and, per
    request, (token ids, text, finish reason, error code or None), once every request ended
    and the executor holds no sequence and no step in flight."""
    from scheduler_svc.engine import Engine
    from scheduler_svc.tokenizer import Tokenizer as ServingTokenizer

    async def main():
        sched = make_scheduler(
            num_blocks=fake.num_blocks, block_size=fake.block_size, num_host_blocks=fake.num_host_blocks, **cfg
        )
        engine = Engine(sched, fake, ServingTokenizer(tokenizer_dir), frozenset({EOS}), 100, 5.0)
        engine.start()

        async def one(prompt, max_tokens, stop, abort_after):
            stream = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop))
            deltas = []
            while True:
                d = await stream.queue.get()
                deltas.append(d)
                if d.finished or d.error:
                    break
                if abort_after is not None and len(deltas) >= abort_after:
                    engine.abort(stream.request_id)
            tokens = [t for d in deltas for t in d.token_ids]
            error = None if deltas[-1].error is None else deltas[-1].error.code
            return tokens, "".join(d.text for d in deltas), deltas[-1].finish_reason, error

        # 60 s: a deadline only a hung stream reaches (this runs in well under a second)
        results = await asyncio.wait_for(asyncio.gather(*(one(*w) for w in work)), 60)
        for _ in range(10_000):  # a step sent is computed, as a real executor would; the last
            if not sched.has_work() and not fake.seqs and not fake.in_flight:  # drops travel in one more
                break
            await asyncio.sleep(0.001)
        await engine.stop()
        return engine, results

    return asyncio.run(main())


def draw_prompts(data, n):
    """n (prompt, max_tokens) pairs for the engine's property tests: prompts of 1-40 tokens,
    every other one behind a shared prefix of 0-12 (prefix-cache hits), 1-24 tokens each."""
    from hypothesis import strategies as st

    shared = [(11 * j) % 200 + 20 for j in range(data.draw(st.integers(0, 12), label="shared_len"))]
    return [
        (
            (shared if i % 2 else [])
            + [(i * 37 + j * 11) % 200 + 20 for j in range(data.draw(st.integers(1, 40), label="prompt_len"))],
            data.draw(st.integers(1, 24), label="max_tokens"),
        )
        for i in range(n)
    ]


def draw_stops_and_aborts(data, base, texts):
    """Per (prompt, max_tokens) of `base` and the text a probe run produced for it, draws a
    stop string cut from that text (or none) and an abort after k deltas (or none): the fake's
    output depends only on each request's own history, so the stops are hit."""
    from hypothesis import strategies as st

    work = []
    for (prompt, max_tokens), text in zip(base, texts):
        stop = ()
        if text and data.draw(st.booleans(), label="stop"):
            a = data.draw(st.integers(0, len(text) - 1), label="stop_at")
            stop = (text[a : a + data.draw(st.integers(1, 3), label="stop_len")],)
        abort = data.draw(st.one_of(st.none(), st.integers(1, 6)), label="abort_after")
        work.append((prompt, max_tokens, stop, abort))
    return work


@pytest.fixture
def byte_tokenizer_dir(tmp_path: Path) -> Path:
    """A byte-level tokenizer: one token per UTF-8 byte, so multi-byte characters split."""
    return write_byte_tokenizer(tmp_path)


@pytest.fixture
def fakes():
    """The helpers above, for tests (pytest's importlib mode does not import conftest by name)."""

    class _F:
        FakeExecutor = FakeExecutor
        FakeExecutorClient = FakeExecutorClient
        fake_handshake = staticmethod(fake_handshake)
        make_scheduler = staticmethod(make_scheduler)
        make_request = staticmethod(make_request)
        prompt_logprob = staticmethod(prompt_logprob)
        run_to_completion = staticmethod(run_to_completion)
        run_workload = staticmethod(run_workload)
        draw_stops_and_aborts = staticmethod(draw_stops_and_aborts)
        draw_prompts = staticmethod(draw_prompts)
        EOS = EOS
        VOCAB = VOCAB

    return _F
