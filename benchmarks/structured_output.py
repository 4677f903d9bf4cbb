"""Structured output (issue 33): validity, throughput and TTFT against unconstrained, one run.

    .venv/bin/python benchmarks/structured_output.py [--parts validity throughput ttft]

A real two-process server (started here) on the default model (SmolLM2-135M-Instruct,
float32), gRPC `SamplingParams.structured`.

(a) validity: SCHEMAS (nested objects, arrays, enums, anyOf, patterns, required fields), each
    asked for in a chat prompt that shows the schema, greedy and at temperature 1 (seeded);
    an output counts valid when it parses and `jsonschema` accepts it. Goal 100%.
    `--repetition-penalty` / `--presence-penalty` / `--frequency-penalty` sample with them.
(b) throughput: S concurrent streams (default 32), each a 32-token prompt and exactly
    --new-tokens tokens: unconstrained with ignore_eos, constrained with a schema whose
    shortest valid output is longer than that (an array of at least 200 integers), so both
    end by max_tokens with the same counts. Rounds alternate free / schema; median output
    tok/s of each, ratio schema/free. Goal >= 0.9x.
(c) TTFT: one request at a time on an idle server, a text prompt of about --ttft-prompt-len
    tokens (a new one each time, so no prefix-cache hit; text, as clients send, so the
    server tokenizes it while the schema compiles), max_tokens 1; constrained with a schema never
    compiled before (its property name changes each time), so the compile must hide behind
    the prefill. Alternating, median TTFT of each, ratio. Goal <= 1.05x.
(d) overhead (in-process, no server): what one step costs per constrained request on each
    side at S streams: the scheduler's S mask rows (llguidance, mid-output of LONG_SCHEMA
    and of a nested object schema), the plan's protobuf with S rows vs none, and the
    executor's masking of S rows of 49152 logits (executor_svc.sampler.apply_token_masks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "README.md").read_text() + (ROOT / "docs" / "architecture.md").read_text()

S = {"type": "string"}
I = {"type": "integer"}  # noqa: E741
B = {"type": "boolean"}


def obj(required: bool = True, **props: object) -> dict:
    out = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = list(props)
    return out


SCHEMAS: list[dict] = [
    obj(name=S, age=I),
    obj(title=S, done=B),
    obj(city=S, population=I, capital=B),
    obj(color={"enum": ["red", "green", "blue"]}),
    obj(status={"enum": ["active", "inactive", "banned"]}, id=I),
    obj(tags={"type": "array", "items": S, "maxItems": 5}),
    obj(scores={"type": "array", "items": I, "minItems": 1, "maxItems": 4}),
    obj(user=obj(name=S, email={"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"})),
    obj(point=obj(x=I, y=I)),
    obj(order=obj(id=I, items={"type": "array", "items": obj(sku=S, qty=I), "maxItems": 3})),
    obj(zip={"type": "string", "pattern": "^[0-9]{5}$"}),
    obj(phone={"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}, name=S),
    obj(value={"anyOf": [I, S]}),
    obj(result={"anyOf": [obj(ok=B), obj(error=S)]}),
    obj(size={"anyOf": [{"type": "null"}, {"enum": ["s", "m", "l"]}]}),
    obj(temperature={"type": "number"}, unit={"enum": ["C", "F"]}),
    obj(count={"type": "integer", "minimum": 0, "maximum": 100}),
    obj(name=S, nickname=S, required=False),
    obj(book=obj(title=S, author=obj(first=S, last=S), year=I)),
    obj(matrix={"type": "array", "items": {"type": "array", "items": I, "maxItems": 3}, "maxItems": 3}),
    obj(answer={"enum": ["yes", "no"]}, confidence={"type": "number", "minimum": 0, "maximum": 1}),
    obj(steps={"type": "array", "items": obj(n=I, text=S), "minItems": 1, "maxItems": 3}),
    obj(language={"enum": ["python", "rust", "go"]}, version={"type": "string", "pattern": "^[0-9]+\\.[0-9]+$"}),
    obj(event=obj(name=S, date={"type": "string", "pattern": "^2[0-9]{3}-[01][0-9]-[0-3][0-9]$"})),
    obj(flags=obj(a=B, b=B, c=B)),
    obj(person=obj(name=S, pets={"type": "array", "items": obj(kind={"enum": ["cat", "dog"]}, name=S), "maxItems": 2})),
    obj(sentiment={"enum": ["positive", "negative", "neutral"]}, reasons={"type": "array", "items": S, "maxItems": 3}),
    obj(ip={"type": "string", "pattern": "^[0-9]{1,3}(\\.[0-9]{1,3}){3}$"}),
    obj(product=obj(name=S, price={"type": "number"}, in_stock=B, tags={"type": "array", "items": S, "maxItems": 3})),
    obj(id={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, priority={"enum": [1, 2, 3]}),
    obj(weather=obj(city=S, days={"type": "array", "items": obj(high=I, low=I), "maxItems": 3})),
    obj(kind={"const": "circle"}, radius=I),
    {"type": "array", "items": obj(word=S, length=I), "minItems": 1, "maxItems": 3},
    obj(config=obj(debug=B, level={"enum": ["info", "warn", "error"]}, retries={"type": "integer", "maximum": 9})),
]

# (b): a valid output has at least 200 integers, so --new-tokens ends it first.
LONG_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 200}


def chat_prompt(schema: dict) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You reply with JSON only. Keep every string short: a word or two."},
        {"role": "user", "content": "Give a realistic example JSON value for this JSON schema:\n" + json.dumps(schema)},
    ]


def token_prompts(tokenizer, count: int, length: int, offset: int = 0) -> list[list[int]]:
    """Distinct prompts of exactly `length` tokens cut from real text."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    while len(ids) < length * 2:
        ids = ids + ids
    step = max(1, (len(ids) - length) // max(1, count + offset))
    return [ids[(i + offset) * step : (i + offset) * step + length] for i in range(count)]


async def generate(stub, request) -> tuple[str, int, int, float | None, float]:
    """(text, tokens, finish reason, seconds to the first token, seconds to the end)."""
    start, first, text, n, reason = time.perf_counter(), None, [], 0, 0
    async for msg in stub.Generate(request):
        if msg.token_ids and first is None:
            first = time.perf_counter() - start
        text.append(msg.text)
        n += len(msg.token_ids)
        if msg.finished:
            reason = msg.finish_reason
    return "".join(text), n, reason, first, time.perf_counter() - start


async def validity(stub, concurrency: int, max_tokens: int, penalties: dict[str, float]) -> dict:
    import jsonschema

    from chunkserve.client import build_request
    from chunkserve_contracts.v1 import chunkserve_pb2 as pb

    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, schema: dict, temperature: float) -> tuple[bool, str]:
        req = build_request(
            chat_prompt(schema),
            max_tokens=max_tokens,
            temperature=temperature,
            seed=i if temperature else None,
            structured=pb.StructuredOutput(json_schema=json.dumps(schema)),
            **penalties,
        )
        async with gate:
            text, _, reason, _, _ = await generate(stub, req)
        try:
            jsonschema.validate(json.loads(text), schema)
            return True, text
        except (ValueError, jsonschema.ValidationError) as exc:
            why = "max_tokens" if reason == pb.FINISH_REASON_LENGTH else type(exc).__name__
            return False, f"schema {i} t={temperature}: {why}: {text[:120]!r}"

    out = {}
    for temperature in (0.0, 1.0):
        results = await asyncio.gather(*(one(i, s, temperature) for i, s in enumerate(SCHEMAS)))
        good = sum(ok for ok, _ in results)
        out[temperature] = (good, len(results))
        print(f"validity t={temperature}: {good}/{len(results)} valid ({100 * good / len(results):.1f}%)", flush=True)
        for ok, text in results:
            if not ok:
                print("   invalid:", text, flush=True)
    return out


async def throughput(stub, prompts: list[list[int]], new_tokens: int, rounds: int) -> dict:
    from chunkserve.client import build_request
    from chunkserve_contracts.v1 import chunkserve_pb2 as pb

    structured = pb.StructuredOutput(json_schema=json.dumps(LONG_SCHEMA))

    async def round_(constrained: bool) -> float:
        extra = dict(structured=structured) if constrained else dict(ignore_eos=True)
        reqs = [build_request(p, temperature=0.0, max_tokens=new_tokens, **extra) for p in prompts]
        start = time.perf_counter()
        counts = await asyncio.gather(*(generate(stub, r) for r in reqs))
        elapsed = time.perf_counter() - start
        total = sum(n for _, n, _, _, _ in counts)
        if total != len(prompts) * new_tokens:
            raise RuntimeError(f"expected {len(prompts) * new_tokens} tokens, got {total}")
        return total / elapsed

    await round_(True)  # warm-up: compiles the schema once (then cached)
    free, schema = [], []
    for r in range(rounds):
        for constrained in (False, True) if r % 2 == 0 else (True, False):
            tps = await round_(constrained)
            (schema if constrained else free).append(tps)
            print(f"throughput {'schema' if constrained else 'free  '}: {tps:7.1f} output tok/s", flush=True)
    f, s = statistics.median(free), statistics.median(schema)
    print(f"throughput median: free {f:.1f}, schema {s:.1f} tok/s, ratio {s / f:.3f}x", flush=True)
    return {"free": free, "schema": schema, "ratio": s / f}


async def ttft(stub, prompts: list[str], trials: int) -> dict:
    from chunkserve.client import build_request
    from chunkserve_contracts.v1 import chunkserve_pb2 as pb

    free, schema = [], []
    for t in range(trials):
        for constrained in (False, True) if t % 2 == 0 else (True, False):
            prompt = prompts[2 * t + constrained]
            # a schema never compiled before: its property name is new
            fresh = {"type": "object", "properties": {f"field_{t}": S, "n": I}, "required": [f"field_{t}", "n"]}
            extra = dict(structured=pb.StructuredOutput(json_schema=json.dumps(fresh))) if constrained else {}
            _, _, _, first, _ = await generate(stub, build_request(prompt, temperature=0.0, max_tokens=1, **extra))
            (schema if constrained else free).append(first)
            print(f"ttft {'schema' if constrained else 'free  '}: {1000 * first:7.1f} ms", flush=True)
    f, s = statistics.median(free), statistics.median(schema)
    paired = statistics.median(b / a for a, b in zip(free, schema))  # each trial's pair ran back to back
    print(
        f"ttft median: free {1000 * f:.1f} ms, schema {1000 * s:.1f} ms, ratio {s / f:.3f}x; "
        f"median of the paired ratios {paired:.3f}x",
        flush=True,
    )
    return {"free": free, "schema": schema, "ratio": s / f, "paired_ratio": paired}


def overhead(path: Path, streams: int, repeats: int = 50) -> dict:
    import torch

    from chunkserve_contracts.executor.v1 import executor_pb2 as epb
    from executor_svc.sampler import apply_token_masks
    from scheduler_svc.grammar import LLGuidanceCompiler
    from scheduler_svc.structured import Constraint

    tokenizer_json = (path / "tokenizer.json").read_text()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    compiler = LLGuidanceCompiler(tokenizer_json, vocab, [2])
    out: dict = {}
    prefixes = {"LONG_SCHEMA": (LONG_SCHEMA, "[1, 22, 333, 4"), "nested object": (SCHEMAS[25], '{"person": {"na')}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    for name, (schema, prefix) in prefixes.items():
        matchers = [compiler.compile_now(Constraint.make("json_schema", json.dumps(schema))) for _ in range(streams)]
        for m in matchers:
            for t in tok.encode(prefix, add_special_tokens=False).ids:
                assert m.accept(t), prefix
        start = time.perf_counter()
        for _ in range(repeats):
            rows = [m.token_mask() for m in matchers]
        ms = (time.perf_counter() - start) / repeats * 1000
        out[f"scheduler masks ({name})"] = ms
        print(f"overhead: {streams} mask rows ({name}): {ms:.2f} ms per step", flush=True)
    entry = dict(seq_id=1, num_computed_tokens=100, num_new_tokens=1, sample=True)
    plain = epb.StepRequest(seqs=[epb.ScheduledSequence(**entry) for _ in range(streams)])
    masked = epb.StepRequest(
        seqs=[epb.ScheduledSequence(**entry, token_masks=[epb.TokenMask(position=0, bits=r)]) for r in rows]
    )
    for name, msg in (("plan without rows", plain), ("plan with rows", masked)):
        start = time.perf_counter()
        for _ in range(repeats):
            epb.StepRequest.FromString(msg.SerializeToString())
        ms = (time.perf_counter() - start) / repeats * 1000
        out[name] = ms
        print(f"overhead: {name}: {len(msg.SerializeToString())} bytes, {ms:.3f} ms to serialize + parse", flush=True)
    logits = torch.randn(streams, vocab)
    masks = dict(enumerate(rows))
    start = time.perf_counter()
    for _ in range(repeats):
        apply_token_masks(logits, masks)
    ms = (time.perf_counter() - start) / repeats * 1000
    out["executor masking"] = ms
    print(f"overhead: executor masking of {streams} x {vocab} logits: {ms:.2f} ms per step", flush=True)
    compiler.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["overhead", "validity", "throughput", "ttft"])
    ap.add_argument("--model", default="default", help="default, tiny, or a folder (chunkserve.launch.bench_model)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="throughput rounds of each kind")
    ap.add_argument("--validity-max-tokens", type=int, default=256)
    ap.add_argument("--validity-concurrency", type=int, default=34)
    for name in ("repetition", "presence", "frequency"):
        ap.add_argument(f"--{name}-penalty", type=float, help="validity: sample with this penalty too")
    ap.add_argument("--ttft-prompt-len", type=int, default=2048)
    ap.add_argument("--ttft-trials", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    import grpc
    from tokenizers import Tokenizer

    from chunkserve.launch import bench_model, start_server
    from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

    path = bench_model(args.model)
    figures: dict = {"model": str(path), "budget": args.max_num_batched_tokens}
    if "overhead" in args.parts:
        figures["overhead"] = overhead(path, args.streams)
    if not set(args.parts) - {"overhead"}:
        print(json.dumps(figures, indent=2)) if args.json is None else args.json.write_text(json.dumps(figures))
        return
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    budget = str(args.max_num_batched_tokens)
    server = start_server(
        Path(tempfile.mkdtemp()),
        ["--model", str(path), "--dtype", "float32", "--max-num-batched-tokens", budget],
        ["--max-num-batched-tokens", budget, "--max-num-seqs", str(max(args.streams, args.validity_concurrency))],
    )

    async def run() -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            if "validity" in args.parts:
                penalties = {
                    f"{n}_penalty": v
                    for n in ("repetition", "presence", "frequency")
                    if (v := getattr(args, f"{n}_penalty")) is not None
                }
                figures["validity"] = await validity(
                    stub, args.validity_concurrency, args.validity_max_tokens, penalties
                )
            if "throughput" in args.parts:
                prompts = token_prompts(tokenizer, args.streams, 32)
                figures["throughput"] = await throughput(stub, prompts, args.new_tokens, args.rounds)
            if "ttft" in args.parts:
                ids = token_prompts(tokenizer, 2 * args.ttft_trials, args.ttft_prompt_len, offset=1)
                prompts = [tokenizer.decode(p) for p in ids]
                figures["ttft"] = await ttft(stub, prompts, args.ttft_trials)

    try:
        asyncio.run(run())
    finally:
        server.stop()
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
