"""A plan is validated whole before it changes anything (issue #13): a refused plan leaves the
runner's sequences, block holders, device KV and host KV exactly as they were, and the
plans the scheduler legitimately sends (prefix sharing, swap out and back in) still pass."""

from __future__ import annotations

import math
from concurrent import futures

import grpc
import pytest
import torch
import transformers
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from chunkserve.launch import tiny_llama_config
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.config import ExecutorConfig
from executor_svc.plan_check import PlanError
from executor_svc.runner import ModelRunner
from executor_svc.server import ExecutorServicer
from executor_svc.worker import load
from scheduler_svc.validation import MAX_LOGPROBS

GREEDY = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
BS, NUM_BLOCKS, MAX_LEN, VOCAB, BUDGET = 4, 32, 256, 128, 64


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A random tiny Llama (context 256) behind the real loader: 32 device blocks of 4 tokens,
    ~500 host blocks, 64 tokens per step."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=VOCAB, max_position_embeddings=MAX_LEN, initializer_range=0.2)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small gains nothing from more; on busy cores it loses 30x
    yield load(
        ExecutorConfig(
            model=str(path),
            dtype="float32",
            block_size=BS,
            num_gpu_blocks_override=NUM_BLOCKS,
            swap_space=0.001,
            max_num_batched_tokens=BUDGET,
            cache_dir=str(path / "cache"),
        )
    )
    torch.set_num_threads(threads)


@pytest.fixture
def runner(loaded):
    r = loaded.runner
    r.reset()
    r.kv_cache.zero_()
    return r


def entry(seq_id, computed, n, tokens=(), blocks=(), sample=False, replace=False):
    return epb.ScheduledSequence(
        seq_id=seq_id,
        num_computed_tokens=computed,
        num_new_tokens=n,
        token_ids=list(tokens),
        block_ids=list(blocks),
        sample=sample,
        replace_block_table=replace,
    )


def new(*seq_ids, sampling=GREEDY):
    return [epb.NewSequence(seq_id=s, sampling=sampling) for s in seq_ids]


def kv_bytes(r):
    """The device and host KV caches as raw bytes: a refused plan must not move one bit."""
    return r.kv_cache.view(torch.int32).clone(), r.host_cache.view(torch.int32).clone()


def snapshot(r):
    """Everything a plan may change."""
    seqs = {
        sid: (repr(s.sampling), list(s.block_table), s.num_computed_tokens, s.last_token, s.holds_blocks)
        for sid, s in r.seqs.items()
    }
    return (seqs, list(r.holders), *kv_bytes(r))


def assert_unchanged(r, before):
    seqs, holders, kv, host = snapshot(r)
    assert seqs == before[0]
    assert holders == before[1]
    assert torch.equal(kv, before[2]), "the device KV cache changed"
    assert torch.equal(host, before[3]), "the host KV cache changed"


def recount(r):
    """holders recomputed from the sequences that hold their blocks."""
    counts = [0] * r.num_blocks
    for s in r.seqs.values():
        if s.holds_blocks:
            for b in s.block_table:
                counts[b] += 1
    return counts


# ---- the three reported cases ----------------------------------------------------------


def test_refused_plan_registers_none_of_its_new_sequences(runner):
    """Issue #13 case 4: 5000 new sequences and an out-of-range block; they must not stay known."""
    bad = epb.StepRequest(
        step_id=1, new_seqs=new(*range(1, 5001)), seqs=[entry(1, 0, 1, [5], [runner.num_blocks], sample=True)]
    )
    with pytest.raises(PlanError, match="block id"):
        runner.execute(bad)
    for k in (1, 2, 4999):  # later legitimate requests with those ids work
        r = runner.execute(
            epb.StepRequest(step_id=1 + k, new_seqs=new(k), seqs=[entry(k, 0, 3, [1, 2, 3], [k % 8], True)])
        )
        assert [s.seq_id for s in r.sampled] == [k]
        runner.execute(epb.StepRequest(step_id=2 + k, finished_seq_ids=[k]))
    assert runner.seqs == {}


def test_refused_swap_in_copies_nothing(runner):
    """Issue #13 case 5: every device block <- host 0, then one bad copy. Nothing may be
    copied, and a prefix-cache hit afterwards must still give the same greedy token."""
    prompt = [7, 3, 9, 11, 2, 40, 5, 8]
    first = runner.execute(epb.StepRequest(step_id=1, new_seqs=new(1), seqs=[entry(1, 0, 8, prompt, [0, 1], True)]))
    runner.execute(epb.StepRequest(step_id=2, finished_seq_ids=[1]))  # blocks 0, 1 stay cached
    runner.host_cache[:, :, 0] = torch.randn_like(runner.host_cache[:, :, 0])
    kv, host = kv_bytes(runner)
    swaps = [epb.BlockCopy(src=0, dst=d) for d in range(runner.num_blocks)]
    bad = epb.StepRequest(step_id=3, swap_in=swaps + [epb.BlockCopy(src=0, dst=runner.num_blocks)])
    with pytest.raises(PlanError, match="out of range"):
        runner.execute(bad)
    after_kv, after_host = kv_bytes(runner)
    assert torch.equal(after_kv, kv), "a refused plan copied blocks into the device KV cache"
    assert torch.equal(after_host, host)
    hit = runner.execute(epb.StepRequest(step_id=4, new_seqs=new(2), seqs=[entry(2, 4, 4, prompt[4:], [0, 5], True)]))
    assert hit.sampled[0].token_id == first.sampled[0].token_id


def test_new_sequence_past_the_context_with_repeated_blocks_is_refused(runner):
    """Issue #13 case 6: position 256 of a 256-token model, reached by repeating block 0."""
    kv, _ = kv_bytes(runner)
    bad = epb.StepRequest(step_id=1, new_seqs=new(1), seqs=[entry(1, MAX_LEN, 1, [5], [0] * 65, sample=True)])
    with pytest.raises(PlanError, match="max_model_len|twice"):
        runner.execute(bad)
    assert runner.seqs == {} and torch.equal(kv_bytes(runner)[0], kv)


# ---- each rule on its own ----------------------------------------------------------------


def test_positions_past_max_model_len_are_refused_even_with_enough_distinct_blocks(loaded):
    base = loaded.runner
    shape = list(base.kv_cache.shape)
    shape[2] = 80  # 320 token slots, more than the model's 256 positions
    r = ModelRunner(base.model, torch.zeros(shape), None, VOCAB, BUDGET, MAX_LEN)
    plan = epb.StepRequest(step_id=1, new_seqs=new(1), seqs=[entry(1, MAX_LEN - 1, 2, [1, 2], range(65), True)])
    with pytest.raises(PlanError, match="positions up to 256 exceed max_model_len 256"):
        r.execute(plan)
    assert r.seqs == {}
    plan.seqs[0].num_new_tokens, plan.seqs[0].token_ids[:] = 1, [1]  # the last position is fine
    assert len(r.execute(plan).sampled) == 1


def test_max_model_len_defaults_to_the_models(loaded):
    assert loaded.runner.max_model_len == MAX_LEN == loaded.handshake.model.max_position_embeddings


@pytest.mark.parametrize(
    "make, message",
    [
        # a block id twice in one table, read-only or not
        (lambda: [entry(3, 8, 1, [1], [0, 0, 9], True)], "twice"),
        # a new sequence writes into a block that sequence 1 holds (its only legitimate sharing is reading)
        (lambda: [entry(3, 0, 2, [1, 2], [2], True)], "writes into block 2"),
        (lambda: [entry(3, 4, 2, [1, 2], [0, 1], True)], "writes into block 1"),
        # two sequences of one plan write the same block
        (lambda: [entry(3, 0, 2, [1, 2], [9]), entry(4, 0, 2, [1, 2], [9])], "writes into block 9"),
        # a running sequence appends a block another holds, or one it holds already
        (lambda: [entry(1, 9, 1, blocks=[5], sample=True)], "appends block 5"),
        (lambda: [entry(1, 9, 1, blocks=[1], sample=True)], "appends block 1"),
        # sequence 1 writes its last block while a new sequence of the same plan reads it
        (lambda: [entry(1, 9, 1, sample=True), entry(3, 12, 1, [1], [0, 1, 2, 9], True)], "writes into block 2"),
    ],
)
def test_writes_into_blocks_others_hold_are_refused(runner, make, message):
    # sequence 1 holds [0, 1, 2] with 9 tokens computed; sequence 2 holds [5]
    runner.execute(
        epb.StepRequest(
            step_id=1,
            new_seqs=new(1, 2),
            seqs=[entry(1, 0, 9, range(9), [0, 1, 2], True), entry(2, 0, 3, [4, 5, 6], [5], True)],
        )
    )
    before = snapshot(runner)
    seqs = make()
    news = [s.seq_id for s in seqs if s.seq_id > 2]
    with pytest.raises(PlanError, match=message):
        runner.execute(epb.StepRequest(step_id=2, new_seqs=new(*news), seqs=seqs))
    assert_unchanged(runner, before)


def test_prefix_sharing_reads_are_accepted_and_match_a_fresh_prefill(runner):
    """The scheduler's prefix-cache hit: a new sequence's leading blocks are a live one's."""
    prompt = [(i * 7 + 3) % VOCAB for i in range(11)]
    a = runner.execute(epb.StepRequest(step_id=1, new_seqs=new(1), seqs=[entry(1, 0, 11, prompt, [3, 4, 5], True)]))
    # sequence 2 shares blocks 3, 4 (8 computed tokens) and computes the last 3 in block 6;
    # sequence 3 shares them too in the same step, while sequence 1 decodes in its own block 5
    r = runner.execute(
        epb.StepRequest(
            step_id=2,
            new_seqs=new(2, 3),
            seqs=[
                entry(1, 11, 1, sample=True),
                entry(2, 8, 3, prompt[8:], [3, 4, 6], True),
                entry(3, 8, 3, prompt[8:], [3, 4, 7], True),
            ],
        )
    )
    assert [s.token_id for s in r.sampled][1:] == [a.sampled[0].token_id] * 2
    assert runner.holders[3] == runner.holders[4] == 3 and runner.holders == recount(runner)


def test_swap_out_and_back_in_with_a_fresh_table(runner):
    """The scheduler's swap protocol: the swapped sequence's blocks go to others, it comes back
    with replace_block_table; a sequence sharing all of its blocks with it keeps running."""
    prompt = [(i * 5 + 1) % VOCAB for i in range(10)]
    runner.execute(epb.StepRequest(step_id=1, new_seqs=new(1), seqs=[entry(1, 0, 8, prompt[:8], [0, 1], True)]))
    # 2 shares all of 1's blocks (both full), plus its own block 2
    runner.execute(epb.StepRequest(step_id=2, new_seqs=new(2), seqs=[entry(2, 8, 2, prompt[8:], [0, 1, 2], True)]))
    ref = runner.execute(
        epb.StepRequest(step_id=3, new_seqs=new(9), seqs=[entry(9, 0, 10, prompt, [20, 21, 22], True)])
    )
    runner.execute(epb.StepRequest(step_id=4, finished_seq_ids=[9]))
    # 2 is swapped out; 1 (whose table is a prefix of 2's) is not, and block 2 goes to a new sequence 3
    runner.execute(
        epb.StepRequest(
            step_id=5,
            swap_out=[epb.BlockCopy(src=b, dst=h) for b, h in ((0, 0), (1, 1), (2, 2))],
            new_seqs=new(3),
            seqs=[entry(3, 0, 4, [1, 2, 3, 4], [2])],
        )
    )
    assert runner.holders == recount(runner) and not runner.seqs[2].holds_blocks
    runner.execute(epb.StepRequest(step_id=6, seqs=[entry(1, 8, 1, blocks=[9], sample=True)]))  # 1 appends
    assert runner.seqs[1].holds_blocks and runner.holders == recount(runner)
    # 2 comes back into fresh blocks and decodes its sampled token, like the reference did
    back = runner.execute(
        epb.StepRequest(
            step_id=7,
            swap_in=[epb.BlockCopy(src=h, dst=b) for h, b in ((0, 10), (1, 11), (2, 12))],
            seqs=[entry(2, 10, 1, blocks=[10, 11, 12], sample=True, replace=True)],
        )
    )
    dec = runner.execute(
        epb.StepRequest(
            step_id=8, new_seqs=new(9), seqs=[entry(9, 0, 11, prompt + [ref.sampled[0].token_id], [20, 21, 22], True)]
        )
    )
    assert back.sampled[0].token_id == dec.sampled[0].token_id
    assert runner.holders == recount(runner)


def test_resuming_without_a_new_table_is_caught_when_it_writes_a_reused_block(runner):
    runner.execute(epb.StepRequest(step_id=1, new_seqs=new(1), seqs=[entry(1, 0, 6, range(6), [0, 1], True)]))
    runner.execute(
        epb.StepRequest(
            step_id=2,
            swap_out=[epb.BlockCopy(src=0, dst=0), epb.BlockCopy(src=1, dst=1)],
            new_seqs=new(2),
            seqs=[entry(2, 0, 5, range(5), [1, 0])],
        )
    )
    before = snapshot(runner)
    with pytest.raises(PlanError, match="writes into block 1"):  # 1's stale table: block 1 is 2's now
        runner.execute(epb.StepRequest(step_id=3, seqs=[entry(1, 6, 1, sample=True)]))
    assert_unchanged(runner, before)


@pytest.mark.parametrize(
    "swap_in, seqs, message",
    [
        # into a block no table of the plan installs (a free block the prefix cache may still hold)
        ([(0, 9)], [], "swap-in destination 9"),
        # into a block sequence 1 holds
        ([(0, 0), (1, 10)], [entry(5, 5, 1, blocks=[0, 10], replace=True)], "writes into block 0|destination 0"),
        ([(0, 10), (1, 10)], [entry(5, 5, 1, blocks=[10, 11], replace=True)], "destination 10 appears twice"),
        ([(0, 10), (9999, 11)], [entry(5, 5, 1, blocks=[10, 11], replace=True)], "out of range"),
    ],
)
def test_bad_swap_ins_are_refused(runner, swap_in, seqs, message):
    runner.execute(
        epb.StepRequest(
            step_id=1,
            new_seqs=new(1, 5),
            seqs=[entry(1, 0, 3, [1, 2, 3], [0], True), entry(5, 0, 5, range(5), [3, 4], True)],
        )
    )
    runner.execute(epb.StepRequest(step_id=2, swap_out=[epb.BlockCopy(src=3, dst=0), epb.BlockCopy(src=4, dst=1)]))
    before = snapshot(runner)
    with pytest.raises(PlanError, match=message):
        runner.execute(epb.StepRequest(step_id=3, swap_in=[epb.BlockCopy(src=h, dst=d) for h, d in swap_in], seqs=seqs))
    assert_unchanged(runner, before)


def test_bad_swap_outs_are_refused(runner):
    runner.execute(epb.StepRequest(step_id=1, new_seqs=new(1), seqs=[entry(1, 0, 3, [1, 2, 3], [0], True)]))
    before = snapshot(runner)
    for swap_out, message in (
        ([(0, 0), (0, 0)], "destination 0 appears twice"),
        ([(0, 0), (NUM_BLOCKS, 1)], "out of range"),
        ([(0, runner.num_host_blocks)], "out of range"),
    ):
        with pytest.raises(PlanError, match=message):
            runner.execute(epb.StepRequest(step_id=2, swap_out=[epb.BlockCopy(src=s, dst=d) for s, d in swap_out]))
        assert_unchanged(runner, before)


def test_finished_ids_apply_only_with_a_valid_plan(runner):
    runner.execute(epb.StepRequest(step_id=1, new_seqs=new(1), seqs=[entry(1, 0, 3, [1, 2, 3], [0], True)]))
    before = snapshot(runner)
    with pytest.raises(PlanError):
        runner.execute(epb.StepRequest(step_id=2, finished_seq_ids=[1, 404], seqs=[entry(77, 0, 1, [1], [1])]))
    assert_unchanged(runner, before)
    runner.execute(epb.StepRequest(step_id=3, finished_seq_ids=[1, 404, 1]))  # unknown and repeated ids are fine
    assert runner.seqs == {} and runner.holders == [0] * NUM_BLOCKS


def test_a_new_sequence_needs_an_entry(runner):
    with pytest.raises(PlanError, match="new sequence 2 has no entry"):
        runner.execute(epb.StepRequest(step_id=1, new_seqs=new(1, 2), seqs=[entry(1, 0, 1, [1], [0])]))
    assert runner.seqs == {}


BAD_SAMPLING = [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=math.nan), "min_p"),
    (dict(num_logprobs=-2), "num_logprobs"),
    (dict(num_logprobs=MAX_LOGPROBS + 1), "num_logprobs"),
    (dict(num_logprobs=2**31 - 1), "num_logprobs"),
]


def bad_sampling(**change):
    params = epb.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, num_logprobs=2)
    for k, v in change.items():
        setattr(params, k, v)
    return params


@pytest.mark.parametrize("change, message", BAD_SAMPLING)
def test_bad_sampling_params_are_plan_errors(runner, change, message):
    plan = epb.StepRequest(
        step_id=1, new_seqs=new(1, sampling=bad_sampling(**change)), seqs=[entry(1, 0, 2, [1, 2], [0], True)]
    )
    with pytest.raises(PlanError, match=f"new sequence 1: {message}"):
        runner.execute(plan)
    assert runner.seqs == {}


def test_bad_sampling_params_are_invalid_argument_over_grpc(loaded, runner):
    class Aborted(Exception):
        pass

    class Context:
        def abort(self, code, details):
            raise Aborted(code, details)

    with futures.ThreadPoolExecutor(max_workers=1) as compute:
        servicer = ExecutorServicer(loaded, compute)
        plan = epb.StepRequest(
            step_id=1, new_seqs=new(1, sampling=bad_sampling(top_p=0.0)), seqs=[entry(1, 0, 2, [1, 2], [0], True)]
        )
        with pytest.raises(Aborted) as err:
            servicer.Step(plan, Context())
    assert err.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.args[1]


def test_the_logprobs_bound_is_the_schedulers():
    from executor_svc.sequence_spec import MAX_NUM_LOGPROBS

    assert MAX_NUM_LOGPROBS == MAX_LOGPROBS


# ---- property: any one corruption of a valid plan is refused and changes nothing --------


def setup_state(r):
    """1: 10 tokens computed in [0, 1, 2], last token known. 2: 8 of 10 prompt tokens in [3, 6].
    3: 5 tokens, last token known, swapped out to host blocks 0, 1. Free: 4, 5, 7..31."""
    r.execute(
        epb.StepRequest(
            step_id=1,
            new_seqs=new(1, 2, 3),
            seqs=[
                entry(1, 0, 9, range(9), [0, 1, 2], True),
                entry(2, 0, 4, range(20, 24), [3]),
                entry(3, 0, 5, range(30, 35), [4, 5], True),
            ],
        )
    )
    r.execute(
        epb.StepRequest(
            step_id=2,
            swap_out=[epb.BlockCopy(src=4, dst=0), epb.BlockCopy(src=5, dst=1)],
            seqs=[entry(1, 9, 1, sample=True), entry(2, 4, 4, range(24, 28), [6])],
        )
    )


@st.composite
def valid_plans(draw):
    """A plan the scheduler could send after setup_state, and the free blocks it leaves."""
    plan = epb.StepRequest(step_id=3)
    free = [4, 5] + list(range(7, NUM_BLOCKS))
    free = draw(st.permutations(free))
    finish = draw(st.sampled_from(["none", "1", "2", "3", "unknown"]))
    if finish != "none":
        plan.finished_seq_ids.append({"1": 1, "2": 2, "3": 3, "unknown": 999}[finish])
    if finish != "1" and draw(st.booleans()):
        plan.seqs.append(entry(1, 10, 1, sample=True))
    if finish != "2":
        if draw(st.booleans()):
            plan.seqs.append(entry(2, 8, 2, [28, 29], [free.pop()], True))
        elif draw(st.booleans()):
            plan.swap_out.extend([epb.BlockCopy(src=3, dst=2), epb.BlockCopy(src=6, dst=3)])
            free += [3, 6]  # freed by the swap-out, copied before anything overwrites them
    if finish != "3" and draw(st.booleans()):
        dst = [free.pop(), free.pop()]
        plan.swap_in.extend([epb.BlockCopy(src=0, dst=dst[0]), epb.BlockCopy(src=1, dst=dst[1])])
        plan.seqs.append(entry(3, 5, 1, blocks=dst, sample=True, replace=True))
    if draw(st.booleans()):  # a prefix-cache hit on 1's two full blocks
        n = draw(st.integers(1, 8))
        plan.new_seqs.append(epb.NewSequence(seq_id=4, sampling=GREEDY))
        plan.seqs.append(
            entry(
                4,
                8,
                n,
                draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)),
                [0, 1] + [free.pop() for _ in range(-(-n // BS))],
                True,
            )
        )
    if draw(st.booleans()) or not plan.seqs:
        n = draw(st.integers(1, 12))
        sampling = epb.SamplingParams(
            temperature=draw(st.floats(0, 2)),
            top_k=draw(st.integers(0, 10)),
            top_p=draw(st.floats(0.01, 1)),
            min_p=draw(st.floats(0, 1)),
            has_seed=True,
            seed=draw(st.integers(0, 2**64 - 1)),
            num_logprobs=draw(st.integers(-1, MAX_LOGPROBS)),
        )
        plan.new_seqs.append(epb.NewSequence(seq_id=5, sampling=sampling))
        plan.seqs.append(
            entry(
                5,
                0,
                n,
                draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)),
                [free.pop() for _ in range(-(-n // BS))],
                True,
            )
        )
    order = draw(st.permutations(range(len(plan.seqs))))
    seqs = [epb.ScheduledSequence() for _ in order]
    for copy, i in zip(seqs, order):
        copy.CopyFrom(plan.seqs[i])
    del plan.seqs[:]
    plan.seqs.extend(seqs)
    return plan, free


def write_block(e: epb.ScheduledSequence) -> int:
    """The last block entry e writes (blocks are allocated exactly, as the scheduler does)."""
    return e.block_ids[-1] if e.block_ids else {1: 2}[e.seq_id]


def corruptions(plan: epb.StepRequest, free: list[int]):
    """{kind: [functions]} of the one-field corruptions that apply to plan."""
    out: dict[str, list] = {}
    known = [s for s in plan.seqs if s.seq_id not in {n.seq_id for n in plan.new_seqs}]
    news = [s for s in plan.seqs if s.seq_id in {n.seq_id for n in plan.new_seqs}]
    first = plan.seqs[0]

    def add(kind):
        def deco(fn):
            out.setdefault(kind, []).append(fn)

        return deco

    @add("block id out of range")
    def _(p):
        e = p.seqs[0]
        e.block_ids.append(NUM_BLOCKS + 3) if not e.block_ids else e.block_ids.__setitem__(-1, NUM_BLOCKS)

    add("no tokens")(lambda p: setattr(p.seqs[0], "num_new_tokens", 0))
    add("budget")(lambda p: setattr(p.seqs[0], "num_new_tokens", BUDGET + 1))
    add("unknown sequence")(lambda p: setattr(p.seqs[0], "seq_id", 777))
    add("entry twice")(lambda p: p.seqs.append(p.seqs[0]))
    add("new sequence already known")(
        lambda p: p.new_seqs.append(epb.NewSequence(seq_id=known[0].seq_id if known else 1, sampling=GREEDY))
    )
    add("new sequence without entry")(lambda p: p.new_seqs.append(epb.NewSequence(seq_id=888, sampling=GREEDY)))
    for e in known:
        if not e.replace_block_table:  # an append of a block the sequence holds already
            own = {1: 0, 2: 3}[e.seq_id]
            add("append of a held block")(
                lambda p, sid=e.seq_id, own=own: next(s for s in p.seqs if s.seq_id == sid).block_ids.append(own)
            )
    if first.token_ids:
        add("token id outside the vocabulary")(lambda p: p.seqs[0].token_ids.__setitem__(-1, VOCAB))
        add("token count")(lambda p: p.seqs[0].token_ids.append(1))
    if known:
        add("cursor")(
            lambda p: setattr(
                next(s for s in p.seqs if s.seq_id == known[0].seq_id),
                "num_computed_tokens",
                known[0].num_computed_tokens + 1,
            )
        )
    for e in news:
        sid = e.seq_id
        add("past max_model_len")(
            lambda p, sid=sid: setattr(next(s for s in p.seqs if s.seq_id == sid), "num_computed_tokens", MAX_LEN)
        )
        add("repeated block")(
            lambda p, sid=sid: next(s for s in p.seqs if s.seq_id == sid).block_ids.append(
                next(s for s in p.seqs if s.seq_id == sid).block_ids[-1]
            )
        )
        others = [write_block(o) for o in plan.seqs if o.seq_id != sid]
        if 1 not in plan.finished_seq_ids:
            others.append(2)  # sequence 1's last block
        for b in others:
            add("write into a held block")(
                lambda p, sid=sid, b=b: next(s for s in p.seqs if s.seq_id == sid).block_ids.__setitem__(-1, b)
            )
        for change, _ in BAD_SAMPLING:
            add("sampling parameter")(
                lambda p, sid=sid, change=change: [
                    setattr(n.sampling, k, v) for n in p.new_seqs if n.seq_id == sid for k, v in change.items()
                ]
            )
    if plan.swap_in:
        add("swap-in out of range")(lambda p: setattr(p.swap_in[0], "dst", NUM_BLOCKS))
        add("swap-in host out of range")(lambda p: setattr(p.swap_in[-1], "src", 10**6))
        add("swap-in duplicate destination")(lambda p: setattr(p.swap_in[1], "dst", p.swap_in[0].dst))
        add("swap-in into a free block")(lambda p: setattr(p.swap_in[1], "dst", free[0]))
        add("swap-in into a held block")(lambda p: p.swap_in.append(epb.BlockCopy(src=0, dst=0)))
    if plan.swap_out:
        add("swap-out out of range")(lambda p: setattr(p.swap_out[0], "src", NUM_BLOCKS))
        add("swap-out duplicate host destination")(lambda p: setattr(p.swap_out[1], "dst", p.swap_out[0].dst))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_corruption_of_a_valid_plan_is_refused_and_changes_nothing(runner, data):
    runner.reset()
    setup_state(runner)
    plan, free = data.draw(valid_plans())
    options = corruptions(plan, free)
    kind = data.draw(st.sampled_from(sorted(options)), label="corruption")
    corrupt = data.draw(st.sampled_from(options[kind]))
    event(kind)
    bad = epb.StepRequest()
    bad.CopyFrom(plan)
    corrupt(bad)
    before = snapshot(runner)
    with pytest.raises(PlanError):
        runner.execute(bad)
    assert_unchanged(runner, before)
    runner.execute(plan)  # the plan it came from was valid, and still is
    assert runner.holders == recount(runner)
