"""Structured output in the scheduler: the Constraint value and its checks, compiling with
llguidance (byte-level tokenizer, a model vocabulary with padding past it), the scheduler's
hold on a request whose mask is pending, and whole workloads through the Engine on a fake
executor that samples only tokens the plan's mask row allows.

The fake's token is a function of the sequence's history (read back from its simulated KV)
and the mask, and the mask a function of the output so far, so the tokens of a constrained
request may not depend on chunk size, chunking, preemption mode or async scheduling.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from scheduler_svc.errors import InvalidRequestError
from scheduler_svc.grammar import LLGuidanceCompiler, check_constrained
from scheduler_svc.request import FinishReason, SamplingParams
from scheduler_svc.structured import CONSTRAINT_KINDS, MAX_CHOICES, Constraint, with_json_options
from scheduler_svc.validation import Limits, sampling_params

BLOCK = 4


def allowed_ids(bits: bytes, vocab: int) -> list[int]:
    return [t for t in range(vocab) if bits[t >> 3] >> (t & 7) & 1]


# ---- the Constraint value and the gRPC field ---------------------------------------------


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
TAG = {"type": "structural_tag", "structures": [{"begin": "<f=w>", "schema": CITY, "end": "</f>"}], "triggers": ["<f="]}


def test_constraint_make_accepts_every_kind_and_refuses_bad_specs():
    assert set(CONSTRAINT_KINDS) == {"json_object", "json_schema", "regex", "choice", "grammar", "structural_tag"}
    assert Constraint.make("json_object") == Constraint("json_object", "")
    assert Constraint.make("json_schema", '{"type": "object"}').spec == '{"type": "object"}'
    assert Constraint.choices(["a", "b"]) == Constraint("choice", '["a", "b"]')
    bad = [
        ("xml", "<a/>", "unknown constraint kind"),
        ("json_object", "{}", "takes no spec"),
        ("regex", "", "spec is empty"),
        ("grammar", "", "spec is empty"),
        ("json_schema", "{", "not valid JSON"),
        ("json_schema", "[1]", "must be a JSON object"),
        ("choice", "[]", "non-empty list"),
        ("choice", '["a", ""]', "non-empty strings"),
        ("choice", '["a", 1]', "non-empty strings"),
        ("choice", '"a"', "non-empty list"),
        ("choice", json.dumps(["x"] * (MAX_CHOICES + 1)), "at most"),
        ("regex", "a" * 70_000, "at most"),
        ("structural_tag", "[]", "must be a JSON object"),
        ("structural_tag", json.dumps({**TAG, "format": {}}), "structural_tag.format is not supported"),
        ("structural_tag", json.dumps({**TAG, "type": "other"}), "type must be structural_tag"),
        ("structural_tag", json.dumps({**TAG, "triggers": []}), "triggers must be a non-empty list"),
        ("structural_tag", json.dumps({**TAG, "structures": []}), "list of 1 to 128"),
        ("structural_tag", json.dumps({**TAG, "structures": [{"begin": "<f>", "schema": {}}]}), "exactly begin"),
        (
            "structural_tag",
            json.dumps({**TAG, "structures": [{"begin": "<f>", "schema": [], "end": ""}]}),
            "JSON object",
        ),
        ("structural_tag", json.dumps({**TAG, "triggers": ["<g"]}), "none of the triggers"),
    ]
    for kind, spec, message in bad:
        with pytest.raises(ValueError, match=message):
            Constraint.make(kind, spec)


def _structured(**kind) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="x", sampling=pb.SamplingParams(structured=pb.StructuredOutput(**kind)))


def test_grpc_structured_maps_to_a_constraint_and_names_the_field():
    limits = Limits(100, 300)
    cases = {
        "json_schema": (dict(json_schema='{"type": "integer"}'), Constraint("json_schema", '{"type": "integer"}')),
        "json_object": (dict(json_object=True), Constraint("json_object", "")),
        "regex": (dict(regex="[ab]+"), Constraint("regex", "[ab]+")),
        "choice": (dict(choice=pb.ChoiceList(choices=["yes", "no"])), Constraint.choices(["yes", "no"])),
        "grammar": (dict(grammar='start: "a"'), Constraint("grammar", 'start: "a"')),
        "structural_tag": (dict(structural_tag=json.dumps(TAG)), Constraint("structural_tag", json.dumps(TAG))),
    }
    for kind, (fields, expected) in cases.items():
        assert sampling_params(_structured(**fields), 3, limits).constraint == expected, kind
    assert sampling_params(pb.GenerateRequest(text="x"), 3, limits).constraint is None
    for fields, message in [
        (dict(), "names no constraint"),
        (dict(json_object=False), "json_object must be true"),
        (dict(json_schema="[]"), r"sampling\.structured\.json_schema must be a JSON object"),
        (dict(regex=""), r"sampling\.structured\.regex: the spec is empty"),
        (dict(choice=pb.ChoiceList()), r"sampling\.structured\.choice must be a non-empty list"),
        (dict(structural_tag="{}"), r"sampling\.structured\.structural_tag\.triggers must be"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            sampling_params(_structured(**fields), 3, limits)


def test_a_constraint_refuses_ignore_eos_and_min_tokens():
    c = Constraint.make("regex", "a+")
    check_constrained(SamplingParams(constraint=c))
    check_constrained(SamplingParams(ignore_eos=True, min_tokens=3))  # no constraint: fine
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        check_constrained(SamplingParams(constraint=c, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        check_constrained(SamplingParams(constraint=c, min_tokens=2))


# ---- llguidance ----------------------------------------------------------------------------


@pytest.fixture
def compiler(byte_tokenizer_dir, fakes):
    """llguidance on the byte tokenizer (257 ids) with the fake model's 300-id vocabulary:
    ids 257..299 are the model's padding."""
    c = LLGuidanceCompiler.from_folder(byte_tokenizer_dir, fakes.VOCAB, [fakes.EOS])
    yield c
    c.close()


def test_masks_are_packed_rows_that_never_allow_padding_and_allow_eos_only_when_complete(compiler, fakes):
    m = compiler.compile_now(Constraint.make("regex", "ab[0-9]{1,2}"))
    row = m.token_mask()
    assert len(row) == 4 * ((fakes.VOCAB + 31) // 32)  # 10 int32 words
    assert allowed_ids(row, fakes.VOCAB) == [ord("a")]
    for t in b"ab":
        assert m.accept(t)
    assert allowed_ids(m.token_mask(), fakes.VOCAB) == list(range(ord("0"), ord("9") + 1))
    assert m.accept(ord("7")) and not m.is_stopped()
    after = allowed_ids(m.token_mask(), fakes.VOCAB)
    assert fakes.EOS in after and max(after) == fakes.EOS  # EOS now; padding ids 257.. never
    assert m.accept(ord("1")) and m.is_stopped()
    assert allowed_ids(m.token_mask(), fakes.VOCAB) == [fakes.EOS]
    assert not m.accept(ord("x"))  # refused once complete


def test_every_kind_compiles_and_bad_ones_say_why(compiler, fakes):
    good = [
        Constraint.make("json_object"),
        Constraint.make("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})),
        Constraint.make("regex", "[a-c]+"),
        Constraint.choices(["yes", "no"]),
        Constraint.make("grammar", 'start: "x" item*\nitem: "y" | "z"'),
        Constraint.make("structural_tag", json.dumps(TAG)),
    ]
    for c in good:
        assert allowed_ids(compiler.compile_now(c).token_mask(), fakes.VOCAB), c
    for c, message in [
        (Constraint.make("regex", "[a-"), "regex"),
        (Constraint.make("grammar", "start: nothing"), "nothing"),
        (Constraint.make("json_schema", '{"type": "frobnicate"}'), "frobnicate"),
        (
            Constraint.make(
                "structural_tag",
                json.dumps({**TAG, "structures": [{**TAG["structures"][0], "schema": {"type": "frobnicate"}}]}),
            ),
            "frobnicate",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            compiler.compile_now(c)


def test_rows_have_the_plan_length_when_32_divides_the_vocabulary(byte_tokenizer_dir):
    """llguidance writes one word too many then; the row is cut to ceil(vocab / 32) words."""
    c = LLGuidanceCompiler.from_folder(byte_tokenizer_dir, 288, [256])
    try:
        row = c.compile_now(Constraint.make("regex", "[ab]")).token_mask()
        assert len(row) == 4 * 9 and allowed_ids(row, 288) == [ord("a"), ord("b")]
    finally:
        c.close()


def test_a_compiled_constraint_is_reused_but_each_request_gets_its_own_state(compiler):
    c = Constraint.choices(["ab", "ac"])
    assert compiler.cached(c) is None
    first, second = compiler.compile_now(c), compiler.cached(c)
    assert first.accept(ord("a")) and first.accept(ord("b")) and first.is_stopped()
    assert not second.is_stopped() and second.accept(ord("a")) and second.accept(ord("c"))


def _accepts(compiler, constraint: Constraint, text: str) -> bool:
    """Whether the whole of `text` (bytes as tokens) is an output the constraint allows."""
    m = compiler.compile_now(constraint)
    return all(m.accept(b) for b in text.encode()) and (m.is_stopped() or m.accept(256))


JSON_TEXTS = ['{"x": 1, "y": [1, 2]}', '{"x":1,"y":[1,2]}', '{ "x" :  1 ,\n "y": [ 1,2 ] }', '{"x":  1, "y": [1, 2]}']
XY = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "array", "items": {"type": "integer"}}}}


@pytest.mark.parametrize(
    ("options", "accepted"),
    [
        ({}, [True, False, False, False]),  # chunkserve's default: ", " and ": ", nothing else
        ({"any_whitespace": False}, [False, True, False, False]),  # disable_any_whitespace: true
        ({"any_whitespace": True}, [True, True, True, True]),  # disable_any_whitespace: false
        ({"whitespace_pattern": "[ ]{0,2}"}, [True, True, False, True]),
    ],
)
def test_json_whitespace_options_change_what_the_grammar_allows(compiler, options, accepted):
    """The options as llguidance compiles them, on the text they must allow or refuse."""
    for base in (Constraint.make("json_schema", json.dumps(XY)), Constraint.make("json_object")):
        constraint = with_json_options(base, **options)
        assert [_accepts(compiler, constraint, t) for t in JSON_TEXTS] == accepted, (base.kind, options)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("plain text, no call", True),
        ('call <f=w>{"city": "Paris"}</f> then more', True),
        ('<f=w>{"city": "Oslo"}</f><f=w>{"city": "Paris"}</f>', True),
        ('call <f=w>{"city": "Rome"}</f>', False),  # outside the schema
        ('call <f=x>{"city": "Paris"}</f>', False),  # a trigger begins no structure
        ('call <f=w>{"city": "Paris"}', False),  # never ended
        ('call <f=w>{"city":"Paris"}</f>', False),  # JSON written as everywhere else: ", " and ": "
    ],
)
def test_structural_tags_constrain_only_what_follows_a_trigger(compiler, text, ok):
    assert _accepts(compiler, Constraint.make("structural_tag", json.dumps(TAG)), text) == ok


# No "/" (free text could end an unended call) and never a trigger in free text.
_FREE = st.text(alphabet="ab <>=fw{}", max_size=6).filter(lambda t: "<f=" not in t)
_CALL = st.tuples(st.sampled_from(["Paris", "Oslo", "Rome"]), st.sampled_from(["w", "x"]), st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_FREE, _CALL), max_size=3), _FREE)
def test_structural_tag_texts_are_accepted_exactly_when_every_call_is_whole_and_valid(compiler, parts, tail):
    """Free text (never a trigger) between calls, each call valid or not (a city outside the
    enum, a begin no structure has, an end left out): the grammar accepts the whole text
    exactly when every call is valid."""
    text, valid = "", True
    for free, (city, name, ended) in parts:
        text += free + f'<f={name}>{{"city": "{city}"}}' + ("</f>" if ended else "")
        valid &= city != "Rome" and name == "w" and ended
    text += tail
    assert _accepts(compiler, Constraint.make("structural_tag", json.dumps(TAG)), text) == valid, text


def test_json_options_apply_inside_structural_tags(compiler):
    compact = with_json_options(Constraint.make("structural_tag", json.dumps(TAG)), any_whitespace=False)
    assert compact.kind == "structural_tag"
    assert _accepts(compiler, compact, 'x <f=w>{"city":"Paris"}</f>')
    assert not _accepts(compiler, compact, 'x <f=w>{"city": "Paris"}</f>')
    closed = json.loads(with_json_options(Constraint.make("structural_tag", json.dumps(TAG)), close_objects=True).spec)
    assert closed["structures"][0]["schema"]["additionalProperties"] is False


def test_closed_objects_refuse_other_properties_at_every_level(compiler):
    nested = {
        "type": "object",
        "properties": {
            "a": {"anyOf": [{"type": "object", "properties": {"b": {"type": "integer"}}}, {"type": "null"}]}
        },
        "$defs": {"unused": {"type": "object", "properties": {"properties": {"type": "object"}}}},
    }
    plain = Constraint.make("json_schema", json.dumps(nested))
    closed = with_json_options(plain, close_objects=True)
    for text, open_ok in [
        ('{"a": {"b": 1}}', True),
        ('{"a": {"b": 1}, "z": 1}', True),
        ('{"a": {"b": 1, "z": 2}}', True),
    ]:
        assert _accepts(compiler, plain, text) == open_ok
        assert _accepts(compiler, closed, text) == ("z" not in text)
    schema = json.loads(closed.spec)
    # A property named "properties" is a property, not a keyword: it gains no additionalProperties.
    assert schema["$defs"]["unused"]["properties"]["properties"] == {"type": "object"}


def test_json_options_refuse_what_they_cannot_apply_to():
    with pytest.raises(ValueError, match="not to regex"):
        with_json_options(Constraint.make("regex", "a"), any_whitespace=False)
    with pytest.raises(ValueError, match="contradict"):
        with_json_options(Constraint.make("json_object"), any_whitespace=False, whitespace_pattern=" ")
    json_object = Constraint.make("json_object")
    assert with_json_options(json_object) is json_object  # nothing asked: the very same constraint


_SUBSCHEMA = st.deferred(
    lambda: st.one_of(
        st.fixed_dictionaries({"type": st.just("integer")}),
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(st.sampled_from(["properties", "items", "a", "b"]), _SUBSCHEMA, max_size=3)},
            optional={"additionalProperties": st.one_of(st.booleans(), _SUBSCHEMA)},
        ),
        st.fixed_dictionaries({"type": st.just("array"), "items": _SUBSCHEMA}),
        st.fixed_dictionaries({"anyOf": st.lists(_SUBSCHEMA, min_size=1, max_size=3)}),
    )
)  # fmt: skip


def _objects(schema, path=()):
    """(path, object schema) of every schema with properties, walking subschema keywords only."""
    if "properties" in schema:
        yield path, schema
        for name, sub in schema["properties"].items():
            yield from _objects(sub, (*path, "properties", name))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _objects(schema["additionalProperties"], (*path, "additionalProperties"))
    if "items" in schema:
        yield from _objects(schema["items"], (*path, "items"))
    for i, sub in enumerate(schema.get("anyOf", [])):
        yield from _objects(sub, (*path, "anyOf", i))


@settings(max_examples=200, deadline=None)
@given(_SUBSCHEMA)
def test_closing_objects_adds_exactly_the_missing_additional_properties(schema):
    """Every object schema that lists properties and was silent about others now refuses
    them; one that said anything keeps it; nothing else in the schema changes."""
    closed = json.loads(with_json_options(Constraint.make("json_schema", json.dumps(schema)), close_objects=True).spec)
    before, after = dict(_objects(schema)), dict(_objects(closed))
    assert before.keys() == after.keys()
    for path, obj in after.items():
        said, now = before[path].get("additionalProperties"), obj["additionalProperties"]
        assert now is False if said is None else type(now) is type(said), path  # a subschema is walked itself
    for path, obj in after.items():  # strip what was added: the original comes back
        if "additionalProperties" not in before[path]:
            del obj["additionalProperties"]
    assert closed == schema


# ---- the scheduler's hold on a pending mask ----------------------------------------------


class _Masking:
    """Mixed into the conftest FakeExecutor: samples only what an entry's mask row allows
    (the fake's own choice when allowed, else one picked by the history), and checks that an
    entry of a constrained sequence that samples has exactly one row per sampled position: its
    last, and with drafts each draft position before it (and that every draft is allowed by the
    row before it: the scheduler cuts a draft at its first forbidden token)."""

    vocab = 300

    def execute(self, plan, ran=None):
        for new in plan.new_seqs:
            self.constrained[new.seq_id] = new.sampling.constraint is not None
        for s in plan.seqs:
            assert not s.token_masks or s.sample, "a mask on an entry that does not sample"
            if s.sample:
                assert bool(s.token_masks) == self.constrained[s.seq_id], "mask missing or unasked"
                if s.token_masks:
                    first = s.num_new_tokens - 1 - len(s.draft_token_ids)
                    assert [m.position for m in s.token_masks] == list(range(first, s.num_new_tokens))
                    for m, draft in zip(s.token_masks, s.draft_token_ids):
                        assert draft in allowed_ids(m.bits, self.vocab), "a draft its grammar forbids"
                    self.masked_drafts += len(s.draft_token_ids)
        return super().execute(plan, ran)

    def sample_row(self, entry, row, history):
        token = super().sample_row(entry, row, history)
        if not entry.token_masks:
            return token
        allowed = allowed_ids(entry.token_masks[row].bits, self.vocab)
        assert allowed, "a mask that allows nothing"
        return token if token in allowed else allowed[sum(history) % len(allowed)]


def masking_fake(fakes, *args, **kwargs):
    cls = type("MaskingFake", (_Masking, fakes.FakeExecutor), {})
    fake = cls(*args, **kwargs)
    fake.constrained = {}
    fake.masked_drafts = 0  # draft tokens of constrained entries
    return fake


def test_prefill_runs_while_the_grammar_compiles_and_only_the_sampling_step_waits(fakes, compiler):
    sched = fakes.make_scheduler(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=8)
    fake = masking_fake(fakes, 64, BLOCK)
    constraint = Constraint.choices(["yes", "no"])
    req = fakes.make_request(1, 30, max_tokens=8, constraint=constraint)
    free = fakes.make_request(2, 3, max_tokens=3)
    sched.add_request(req)
    sched.add_request(free)
    while sched.has_work() and (plan := sched.schedule()).seqs:
        assert all(not s.sample for s in plan.seqs if s.seq_id == 1), "sampled before its grammar was ready"
        sched.update(plan, fake.execute(plan))
    assert req.num_computed_tokens == 29 and req.num_output_tokens == 0  # all but the last prompt token
    assert free.is_finished and free.num_output_tokens == 3  # others were not held up
    req.matcher = compiler.compile_now(constraint)  # the compile finished (on the event loop)
    outputs = fakes.run_to_completion(sched, fake)
    text = bytes(t for t in outputs["r1"] if t < 256).decode()
    assert text in ("yes", "no") and req.finish_reason is FinishReason.STOP
    assert sched.pool.num_free_blocks == 64


# ---- whole workloads through the Engine --------------------------------------------------


class GatedCompiler:
    """llguidance behind a gate the test opens: readiness without timing."""

    def __init__(self, inner: LLGuidanceCompiler, open_: bool = True) -> None:
        self.inner, self.gate, self.calls, self.use_cache = inner, asyncio.Event(), 0, False
        if open_:
            self.gate.set()

    async def compile(self, constraint):
        self.calls += 1
        await self.gate.wait()
        return self.inner.compile_now(constraint)

    def cached(self, constraint):
        return self.inner.cached(constraint) if self.use_cache else None

    def prefetch(self, constraint):
        pass


def run_constrained(
    fakes, tokenizer_dir, work, *, fake, compiler, gate_open=True, between=None, use_cache=False, proposer=None, **cfg
):
    """Runs work items (prompt, max_tokens, constraint or None, abort after k deltas or None)
    through an Engine on `fake`; returns the engine and per item (tokens, text, finish reason,
    error code or None) once all ended and nothing is left on the fake. `between(engine,
    gated)` runs once every request is queued (the gate closed unless gate_open)."""
    from scheduler_svc.engine import Engine
    from scheduler_svc.tokenizer import Tokenizer as ServingTokenizer

    async def main():
        sched = fakes.make_scheduler(
            num_blocks=fake.num_blocks, block_size=fake.block_size, num_host_blocks=fake.num_host_blocks, **cfg
        )
        if proposer is not None:
            sched.drafter.proposer = proposer
        gated = GatedCompiler(compiler, gate_open)
        gated.use_cache = use_cache
        engine = Engine(sched, fake, ServingTokenizer(tokenizer_dir), frozenset({256}), 100, 5.0, grammars=gated)
        engine.start()

        async def one(stream, abort_after):
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

        streams = [
            engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=m, constraint=c)) for p, m, c, _ in work
        ]
        tasks = [asyncio.ensure_future(one(s, w[3])) for s, w in zip(streams, work)]
        if between is not None:
            await between(engine, gated)
        gated.gate.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)  # only a hung stream waits that long
        for _ in range(10_000):  # the last drops travel with one more step
            if not sched.has_work() and not fake.seqs and not fake.in_flight:
                break
            await asyncio.sleep(0.001)
        await engine.stop()
        assert engine.grammars.pending == 0
        return engine, results

    return asyncio.run(main())


def reference_run(fakes, tokenizer_dir, work, compiler):
    """Per item (tokens, text, finish reason, error) of a run on a roomy pool with the default
    settings: what every variant of a workload must reproduce."""
    return run_constrained(fakes, tokenizer_dir, work, fake=masking_fake(fakes, 96, BLOCK), compiler=compiler)[1]


def _matches(constraint: Constraint, text: str) -> bool:
    if constraint.kind == "choice":
        return text in json.loads(constraint.spec)
    if constraint.kind == "regex":
        return re.fullmatch(constraint.spec, text) is not None
    if constraint.kind in ("json_schema", "json_object"):
        import jsonschema

        value = json.loads(text)
        schema = json.loads(constraint.spec) if constraint.spec else {"type": "object"}
        jsonschema.validate(value, schema)
        return True
    raise AssertionError(constraint.kind)


SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "tag": {"enum": ["x", "yz"]}, "ok": {"type": "boolean"}},
    "required": ["id", "tag", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    Constraint.choices(["alpha", "beta", "gamma"]),
    Constraint.make("regex", "[a-c]{2,4}-[0-9]{1,3}"),
    Constraint.make("json_schema", json.dumps(SCHEMA)),
    None,  # an unconstrained request shares the batch
    Constraint.make("grammar", 'start: "(" item ("," item)? ("," item)? ")"\nitem: "a" | "bb"'),
]


def _work(n: int = 10):
    return [
        ([(i * 37 + j * 11) % 200 + 20 for j in range(5 + 7 * i % 23)], 48, CONSTRAINTS[i % len(CONSTRAINTS)], None)
        for i in range(n)
    ]


def _check_valid(work, results):
    for (_, _, constraint, _), (_tokens, text, reason, error) in zip(work, results):
        assert error is None
        if constraint is not None:
            assert reason is FinishReason.STOP, (constraint, text)
            if constraint.kind == "grammar":
                assert re.fullmatch(r"\((a|bb)(,(a|bb)){0,2}\)", text), text
            else:
                assert _matches(constraint, text), (constraint, text)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(max_num_batched_tokens=8),
        dict(max_num_batched_tokens=16, enable_prefix_caching=True),
        dict(max_num_batched_tokens=64, enable_chunked_prefill=False),
        dict(max_num_batched_tokens=8, async_scheduling=True),
        dict(max_num_batched_tokens=64, async_scheduling=True, enable_chunked_prefill=False),
    ],
    ids=["chunk8", "chunk16-cache", "whole", "chunk8-async", "whole-async"],
)
def test_constrained_greedy_tokens_do_not_depend_on_chunking_caching_or_async(fakes, byte_tokenizer_dir, compiler, cfg):
    """The same constrained greedy tokens whatever the chunk size, chunking, prefix caching
    or async scheduling, and every one valid; compiles were held back (gate closed) until
    every request was queued and its prefill under way."""
    work = _work()
    reference = reference_run(fakes, byte_tokenizer_dir, work, compiler)
    _check_valid(work, reference)
    fake = masking_fake(fakes, 96, BLOCK)

    async def prefill_first(engine, gated):
        # Steps run while every compile waits: prefill but no constrained sample.
        for _ in range(10_000):
            if not engine.scheduler.waiting and fake.plans and not fake.in_flight:
                break
            await asyncio.sleep(0.001)
        assert gated.calls == sum(c is not None for _, _, c, _ in work)

    engine, results = run_constrained(
        fakes, byte_tokenizer_dir, work, fake=fake, compiler=compiler, gate_open=False, between=prefill_first, **cfg
    )
    assert results == reference
    assert engine.scheduler.pool.num_free_blocks == 96 and not engine.scheduler.requests
    if cfg.get("async_scheduling"):
        assert fake.max_in_flight == 2


class _Oracle:
    """Drafts what a reference run output next, every 4th draft position wrong (by one id: some
    of those the grammar forbids, some it allows and verification rejects)."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]]) -> None:
        self.outputs = outputs

    def prepare(self, req, budget):
        return 0

    def propose(self, req, k):
        done = len(req.output_token_ids)
        ref = self.outputs[tuple(req.prompt_token_ids)][done : done + k]
        return [t if (done + j) % 4 else (t + 1) % 256 for j, t in enumerate(ref)]

    def on_tokens(self, req, new_tokens):
        pass

    def on_finish(self, req):
        pass


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_constrained_drafts_carry_a_mask_row_per_position_and_change_no_token(
    fakes, byte_tokenizer_dir, compiler, async_scheduling
):
    """Speculative decoding on constrained requests: every draft position gets its grammar's
    row, a draft is cut at its first forbidden token (the fake checks both), the matcher rolls
    back over rejected drafts, and the tokens equal a run without drafts."""
    work = _work()
    reference = reference_run(fakes, byte_tokenizer_dir, work, compiler)
    outputs = {tuple(p): r[0] for (p, *_), r in zip(work, reference)}
    fake = masking_fake(fakes, 96, BLOCK)
    spec = '{"method": "ngram", "num_speculative_tokens": 5}'
    engine, results = run_constrained(
        fakes,
        byte_tokenizer_dir,
        work,
        fake=fake,
        compiler=compiler,
        proposer=_Oracle(outputs),
        speculative_config=spec,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    assert results == reference
    _check_valid(work, results)
    assert fake.masked_drafts > 0 and 0 < fake.accepted < fake.drafted
    assert engine.scheduler.pool.num_free_blocks == 96 and not engine.scheduler.requests


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_matcher_right(fakes, byte_tokenizer_dir, compiler, mode):
    """A pool so small that requests are preempted mid-output (recompute re-prefills the
    tokens already output, which the matcher has consumed; swap keeps them): the same tokens
    as an unpressed run, each output valid, nothing leaked."""
    work = _work(8)
    reference = reference_run(fakes, byte_tokenizer_dir, work, compiler)
    for async_scheduling in (False, True):
        fake = masking_fake(fakes, 24, BLOCK, num_host_blocks=64)
        engine, results = run_constrained(
            fakes,
            byte_tokenizer_dir,
            work,
            fake=fake,
            compiler=compiler,
            preemption_mode=mode,
            max_num_batched_tokens=16,
            async_scheduling=async_scheduling,
        )
        assert sum(len(p.preempted) for p in fake.plans) > 0, "no preemption happened"
        if mode == "swap":
            assert any(p.swap_out for p in fake.plans)
        assert results == reference
        assert engine.scheduler.pool.num_free_blocks == 24 and engine.scheduler.host_pool.num_free_blocks == 64


def test_a_constraint_that_does_not_compile_ends_its_request_mid_prefill(fakes, byte_tokenizer_dir, compiler):
    """INVALID_ARGUMENT for the request whose grammar fails (its prefill already began, its
    blocks freed), the others unaffected."""
    bad = Constraint.make("grammar", "start: undefined_rule")
    work = [(list(range(20, 60)), 8, bad, None), (list(range(60, 70)), 8, Constraint.choices(["ok"]), None)]
    fake = masking_fake(fakes, 64, BLOCK)

    async def prefill_first(engine, gated):
        for _ in range(10_000):
            if fake.plans and any(s.seq_id == 1 for p in fake.plans for s in p.seqs) and not fake.in_flight:
                break
            await asyncio.sleep(0.001)

    engine, results = run_constrained(
        fakes,
        byte_tokenizer_dir,
        work,
        fake=fake,
        compiler=compiler,
        gate_open=False,
        between=prefill_first,
        max_num_batched_tokens=8,
    )
    import grpc

    assert results[0][3] == grpc.StatusCode.INVALID_ARGUMENT and results[0][0] == []
    assert results[1][1] == "ok" and results[1][2] is FinishReason.STOP
    assert engine.scheduler.pool.num_free_blocks == 64 and not fake.seqs


def test_abort_while_compiling_releases_everything(fakes, byte_tokenizer_dir, compiler):
    fake = masking_fake(fakes, 64, BLOCK)
    work = [(list(range(20, 50)), 8, Constraint.choices(["yes"]), None), (list(range(50, 55)), 4, None, None)]

    async def abort_first(engine, gated):
        request_id = next(iter(engine.scheduler.requests))
        for _ in range(10_000):  # its prefill under way
            if any(s.seq_id == 1 for p in fake.plans for s in p.seqs) and not fake.in_flight:
                break
            await asyncio.sleep(0.001)
        assert engine.grammars.pending == 1
        assert engine.abort(request_id)
        assert engine.grammars.pending == 0

    engine, results = run_constrained(
        fakes,
        byte_tokenizer_dir,
        work,
        fake=fake,
        compiler=compiler,
        gate_open=False,
        between=abort_first,
        max_num_batched_tokens=8,
    )
    assert results[0][2] is FinishReason.ABORTED and results[0][0] == []
    assert results[1][2] is FinishReason.LENGTH
    assert engine.scheduler.pool.num_free_blocks == 64 and not fake.seqs


def test_no_compiler_refuses_constrained_requests(fakes, byte_tokenizer_dir):
    from scheduler_svc.engine import Engine
    from scheduler_svc.tokenizer import Tokenizer as ServingTokenizer

    async def main():
        sched = fakes.make_scheduler()
        engine = Engine(sched, None, ServingTokenizer(byte_tokenizer_dir), frozenset({256}), 10, 5.0)
        with pytest.raises(InvalidRequestError, match="not available"):
            engine.add_request([1, 2], SamplingParams(constraint=Constraint.choices(["a"])))
        with pytest.raises(InvalidRequestError, match="ignore_eos"):
            engine.add_request([1, 2], SamplingParams(constraint=Constraint.choices(["a"]), ignore_eos=True))
        assert not sched.requests

    asyncio.run(main())


_alnum = st.text(alphabet="abcxyz019-", min_size=1, max_size=6)
_regexes = st.sampled_from(
    ["[a-c]{1,5}", "(yes|no|maybe)", "[0-9]{1,3}(\\.[0-9]{1,2})?", "(foo|bar)-[xyz]{3}", "a(b|cd)?e{0,3}"]
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    n=st.integers(1, 6),
    async_scheduling=st.booleans(),
    budget=st.sampled_from([4, 8, 32]),
    eos_after=st.sampled_from([None, 12, 30]),
)
def test_every_finished_constrained_output_matches(
    fakes, byte_tokenizer_dir, compiler, data, n, async_scheduling, budget, eos_after
):
    """Random choice lists and regexes, random prompts, budgets and EOS pressure from the
    fake: every request ends STOP with text matching its constraint."""
    work = []
    for i in range(n):
        if data.draw(st.booleans(), label="is_choice"):
            constraint = Constraint.choices(data.draw(st.lists(_alnum, min_size=1, max_size=5), label="choices"))
        else:
            constraint = Constraint.make("regex", data.draw(_regexes, label="regex"))
        prompt = [(i * 31 + j * 7) % 200 + 20 for j in range(data.draw(st.integers(1, 20), label="prompt_len"))]
        work.append((prompt, 24, constraint, None))
    fake = masking_fake(fakes, 64, BLOCK, eos_after=eos_after)
    engine, results = run_constrained(
        fakes,
        byte_tokenizer_dir,
        work,
        fake=fake,
        compiler=compiler,
        max_num_batched_tokens=budget,
        async_scheduling=async_scheduling,
    )
    _check_valid(work, results)
    assert engine.scheduler.pool.num_free_blocks == 64


def test_a_constraint_compiled_before_samples_in_the_first_step(fakes, byte_tokenizer_dir, compiler):
    """A cached constraint is ready at admission: no compile, no held-back token, the whole
    prompt and its first sample in one step (the compile is not even started)."""
    constraint = Constraint.choices(["yes", "no"])
    compiler.compile_now(constraint)
    fake = masking_fake(fakes, 64, BLOCK)
    work = [(list(range(30, 40)), 8, constraint, None)]
    engine, results = run_constrained(
        fakes, byte_tokenizer_dir, work, fake=fake, compiler=compiler, gate_open=False, use_cache=True
    )
    first = next(s for p in fake.plans for s in p.seqs)
    assert first.num_new_tokens == 10 and first.sample and first.token_masks
    assert results[0][1] in ("yes", "no")


def test_finishing_a_request_releases_its_matcher(fakes, compiler):
    """Abort mid-output (or any end): the request's grammar state goes with it."""
    sched = fakes.make_scheduler(num_blocks=64, block_size=BLOCK)
    fake = masking_fake(fakes, 64, BLOCK)
    constraint = Constraint.make("regex", "[a-z]{20}")
    req = fakes.make_request(1, 6, max_tokens=30, constraint=constraint)
    req.matcher = compiler.compile_now(constraint)
    sched.add_request(req)
    for _ in range(3):
        plan = sched.schedule()
        sched.update(plan, fake.execute(plan))
    assert req.num_output_tokens == 3 and req.matcher is not None
    sched.abort(req.request_id)
    assert req.matcher is None and req.is_finished and sched.pool.num_free_blocks == 64


def test_prefetch_and_concurrent_compiles_of_one_constraint_build_it_once(compiler, monkeypatch):
    """The servicer prefetches before tokenizing; the request's own compile then shares that
    build (or finds it cached), as do other requests asking for the same constraint."""
    from scheduler_svc import grammar

    built = []
    real = grammar.grammar_text
    monkeypatch.setattr(grammar, "grammar_text", lambda c: built.append(c) or real(c))
    c = Constraint.make("regex", "(ab){1,3}")

    async def main():
        compiler.prefetch(c)
        matchers = await asyncio.gather(*(compiler.compile(c) for _ in range(4)))
        assert len({id(m) for m in matchers}) == 4  # each its own state
        assert all(m.accept(ord("a")) for m in matchers)

    asyncio.run(main())
    assert built == [c]
    with pytest.raises(ValueError, match="regex"):  # a failed build is reported to every asker
        compiler.prefetch(bad := Constraint.make("regex", "(a"))
        compiler.compile_now(bad)
