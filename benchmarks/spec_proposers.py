"""Draft proposers (scheduler_svc/spec, issue 34): their CPU cost per step, and how many drafts
an OFFLINE REPLAY would accept. No model runs here: this is not an end-to-end speedup.

Cost: 32 concurrent requests with histories of 1K / 4K / 16K tokens of real text (this
repository's files, the default model's tokenizer); each step proposes k tokens for every
request, then appends what greedy verification against the text's true continuation would
accept (the accepted prefix plus the model's own token). Printed: microseconds per request-step
(propose + update) for the incremental n-gram index, suffix decoding, and, as the baseline in
the same run, an n-gram lookup that rescans the whole history each step (vLLM's way; here
with bytes.rfind, a C-speed scan); plus the one-time cost of indexing a prompt at admission.

Acceptance: input-grounded workloads, replayed with a known "model output": a copy-heavy
edit of a 1.5K-token document (README.md) and of a code file (scheduler_svc/scheduler.py), an
extractive summary (docs/architecture.md), tool-call JSON repeated across 8 agent requests (the suffix corpus sees
the earlier outputs), and random tokens (nothing to look up). Each step drafts, accepts the
longest prefix that matches the output plus one token. Printed per workload and method:
acceptance rate (accepted / drafted), mean accepted tokens per drafting step, and output
tokens per step (1.00 without speculation: the bound on the speedup if a step with drafts cost
the same as one without, which it does not quite; docs/speculative.md).

    .venv/bin/python benchmarks/spec_proposers.py                  # both parts
    .venv/bin/python benchmarks/spec_proposers.py --part acceptance
    .venv/bin/python benchmarks/spec_proposers.py --part cost --lengths 1024 4096 --steps 32
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from scheduler_svc.spec import AcceptanceTracker, NgramProposer, SuffixProposer, TrackerSettings
from scheduler_svc.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
CORPUS_FILES = ["README.md", "docs/architecture.md", "docs/cpu.md", "docs/tuning.md"] + sorted(
    str(p.relative_to(ROOT)) for d in ("scheduler_svc", "executor_svc", "chunkserve") for p in (ROOT / d).glob("*.py")
)


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)


def load_tokenizer(path: str | None) -> Tokenizer:
    """The default model's tokenizer: from the converted-model cache when it is there (no
    torch), else through the executor's loader (converts the default model once)."""
    if path:
        return Tokenizer(path)
    from executor_svc.config import DEFAULT_MODEL, default_cache_dir

    cached = Path(default_cache_dir()) / "models" / DEFAULT_MODEL
    if (cached / "tokenizer.json").is_file():
        return Tokenizer(cached)
    from chunkserve.launch import bench_model

    return Tokenizer(bench_model("default"))


# ---- the rescan baseline ------------------------------------------------------------------


class RescanNgram:
    """Prompt lookup that rescans the whole history every step (the baseline): the history as
    4-byte big-endian words, searched backwards with bytes.rfind, keeping word-aligned hits."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.tokens: dict[str, list[int]] = {}

    def propose(self, req: Req, k: int) -> list[int]:
        tokens = self.tokens.setdefault(req.request_id, list(req.prompt_token_ids))
        data = b"".join(t.to_bytes(4, "big") for t in tokens)  # what a rescan must build or keep
        length = len(tokens)
        for n in range(self.hi, self.lo - 1, -1):
            if n >= length:
                continue
            pattern, end = data[-4 * n :], len(data) - 4  # an occurrence must end before the last token
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    stop = at // 4 + n
                    return tokens[stop : stop + k]
                end = at + 4 * n - 1
        return []

    def on_tokens(self, req: Req, new: list[int]) -> None:
        self.tokens.setdefault(req.request_id, list(req.prompt_token_ids)).extend(new)

    def on_finish(self, req: Req) -> None:
        self.tokens.pop(req.request_id, None)


# ---- replay -------------------------------------------------------------------------------


@dataclass
class Tally:
    steps: int = 0
    drafts: int = 0  # steps that drafted
    drafted: int = 0
    accepted: int = 0
    output: int = 0

    def add(self, other: Tally) -> None:
        for name in ("steps", "drafts", "drafted", "accepted", "output"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def replay(proposer, req: Req, output: list[int], k: int, tracker: AcceptanceTracker | None = None) -> Tally:
    """Greedy verification against a known output: accept the longest matching prefix of each
    draft, then the output's next token (what the model itself samples in that step)."""
    tally, i = Tally(output=len(output)), 0
    while i < len(output):
        want = tracker.draft_len() if tracker is not None else k
        draft = proposer.propose(req, want)[: len(output) - i - 1] if want else []
        n = 0
        while n < len(draft) and draft[n] == output[i + n]:
            n += 1
        if tracker is not None and draft:
            tracker.record(len(draft), n)
        tally.steps += 1
        tally.drafts += bool(draft)
        tally.drafted += len(draft)
        tally.accepted += n
        proposer.on_tokens(req, output[i : i + n + 1])
        i += n + 1
    proposer.on_finish(req)
    return tally


# ---- workloads ----------------------------------------------------------------------------


def first_tokens(tok: Tokenizer, text: str, budget: int) -> str:
    """The longest run of whole lines of text that tokenizes to at most budget tokens."""
    lines, out = text.splitlines(keepends=True), []
    for line in lines:
        if len(tok.encode("".join(out) + line)) > budget:
            break
        out.append(line)
    return "".join(out)


def edit_lines(text: str, rng: random.Random, rename: tuple[str, str], note: str, p_del: float, p_ins: float) -> str:
    out = []
    for line in text.splitlines(keepends=True):
        if rng.random() < p_del:
            continue
        out.append(re.sub(rf"\b{rename[0]}\b", rename[1], line))
        if rng.random() < p_ins:
            indent = re.match(r"\s*", line).group(0)
            out.append(f"{indent}{note}\n")
    return "".join(out)


def summary_of(text: str) -> str:
    """An extractive summary: the first sentence of every prose paragraph, as a bullet list."""
    out, in_code = ["Summary:\n"], False
    for para in re.split(r"\n\s*\n", text):
        if para.count("```") % 2:
            in_code = not in_code
        first = para.lstrip()
        if in_code or not first or first.startswith(("```", "|", "#", "    ", "-", "*")) or re.match(r"\d+\.", first):
            continue
        sentence = " ".join(first.split("\n")).split(". ")[0].rstrip(".")
        out.append(f"- {sentence}.\n")
    return "".join(out)


def workloads(tok: Tokenizer, doc_tokens: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """name -> [(prompt ids, output ids)], requests replayed in order through one proposer."""
    rng = random.Random(0)

    def chat(instruction: str, body: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": f"{instruction}\n\n{body}"}])

    readme = first_tokens(tok, (ROOT / "README.md").read_text(), doc_tokens)
    code = first_tokens(tok, (ROOT / "scheduler_svc/scheduler.py").read_text(), doc_tokens)
    out: dict[str, list[tuple[list[int], list[int]]]] = {}
    edited = edit_lines(readme, rng, ("scheduler", "planner"), "(Changed in version 2.)", 0.05, 0.05)
    out["edit-readme"] = [
        (
            chat(
                "Rename 'scheduler' to 'planner', drop stale lines, mark changes. Reply with the whole document.",
                readme,
            ),
            tok.encode(edited),
        )
    ]
    edited = edit_lines(code, rng, ("request", "req"), "# reviewed", 0.03, 0.05)
    out["edit-code"] = [
        (
            chat("Rename `request` to `req` and mark reviewed lines. Reply with the whole file.", code),
            tok.encode(edited),
        )
    ]
    out["summarise"] = [
        (chat("Summarise each section of this document in one sentence.", readme), tok.encode(summary_of(readme)))
    ]
    agent = []
    for i, city in enumerate(["Paris", "Lagos", "Lima", "Oslo", "Pune", "Kyoto", "Quito", "Perth"]):
        call = {
            "name": "get_weather",
            "arguments": {"city": city, "unit": "celsius", "days": 1 + i % 3, "hourly": False},
        }
        reply = f"I'll check the weather.\n<tool_call>\n{json.dumps(call, indent=2)}\n</tool_call>"
        agent.append(
            (
                chat("You can call get_weather(city, unit, days, hourly).", f"What is the weather in {city}?"),
                tok.encode(reply),
            )
        )
    out["json-agent (8 requests)"] = agent
    vocab = tok.vocab_size
    out["random tokens"] = [
        ([rng.randrange(vocab) for _ in range(doc_tokens)], [rng.randrange(vocab) for _ in range(300)])
    ]
    return out


def run_acceptance(tok: Tokenizer, k: int, doc_tokens: int) -> None:
    methods: dict[str, Callable[[], object]] = {
        "ngram [2,5]": lambda: NgramProposer(2, 5),
        "ngram [5,5]": lambda: NgramProposer(5, 5),
        "suffix": lambda: SuffixProposer(),
    }
    print(f"\nOFFLINE REPLAY (no model; greedy verification against a known output), k = {k}")
    print(
        f"{'workload':<26} {'method':<22} {'prompt':>6} {'output':>6} {'steps':>6} {'drafted':>7} {'accepted':>8} {'accept rate':>11} {'acc/draft':>9} {'tok/step':>8}"
    )
    for name, requests in workloads(tok, doc_tokens).items():
        for method, make in methods.items():
            for adaptive in (False, True):
                proposer, total = make(), Tally()
                for i, (prompt, output) in enumerate(requests):
                    tracker = AcceptanceTracker(TrackerSettings(k_max=k)) if adaptive else None
                    total.add(replay(proposer, Req(f"{name}-{i}", prompt), output, k, tracker))
                label = f"{method}{' adaptive' if adaptive else ''}"
                rate = total.accepted / total.drafted if total.drafted else 0.0
                per_draft = total.accepted / total.drafts if total.drafts else 0.0
                print(
                    f"{name:<26} {label:<22} {len(requests[0][0]):>6} {sum(len(o) for _, o in requests):>6} {total.steps:>6} "
                    f"{total.drafted:>7} {total.accepted:>8} {rate:>11.2f} {per_draft:>9.2f} {total.output / total.steps:>8.2f}"
                )


# ---- cost ---------------------------------------------------------------------------------


def cost_round(
    make, text: list[int], length: int, concurrency: int, steps: int, k: int, rng: random.Random
) -> tuple[float, float]:
    """(ms to index one prompt at admission, us per request-step of propose + update)."""
    reqs, truths = [], []
    for i in range(concurrency):
        start = rng.randrange(len(text) - length - 4 * steps * (k + 1))
        reqs.append(Req(f"r{i}", text[start : start + length]))
        truths.append(text[start + length :])
    proposer = make()
    t0 = time.perf_counter()
    for req in reqs:
        proposer.on_tokens(req, [])  # first sight: indexes the prompt
    admit = (time.perf_counter() - t0) / concurrency
    pos = [0] * concurrency
    t0 = time.perf_counter()
    for _ in range(steps):
        for j, req in enumerate(reqs):
            draft = proposer.propose(req, k)
            truth, n = truths[j], 0
            while n < len(draft) and draft[n] == truth[pos[j] + n]:
                n += 1
            proposer.on_tokens(req, truth[pos[j] : pos[j] + n + 1])
            pos[j] += n + 1
    per_step = (time.perf_counter() - t0) / (steps * concurrency)
    return admit * 1e3, per_step * 1e6, sum(pos) / (steps * concurrency)


def run_cost(tok: Tokenizer, lengths: list[int], concurrency: int, steps: int, k: int, rounds: int) -> None:
    text: list[int] = []
    for name in CORPUS_FILES:
        text += tok.encode((ROOT / name).read_text())
    corpus_outputs = [text[i : i + 500] for i in range(0, 100 * 500, 500)]

    def suffix_with_corpus() -> SuffixProposer:
        p = SuffixProposer()
        for out in corpus_outputs:  # a warm global corpus: 100 earlier outputs of 500 tokens
            p.add_to_corpus(out)
        return p

    makes = {
        "ngram rescan (baseline)": lambda: RescanNgram(2, 5),
        "ngram [2,5] incremental": lambda: NgramProposer(2, 5),
        "suffix, empty corpus": lambda: SuffixProposer(),
        "suffix, 100-output corpus": suffix_with_corpus,
    }
    print(
        f"\nPROPOSER CPU COST: {concurrency} requests, {steps} steps each, k = {k}, text of {len(text)} tokens; median of {rounds} rounds (ABBA order)"
    )
    print(f"{'history':>7} {'method':<27} {'admit ms/req':>12} {'us/req-step':>11} {'vs rescan':>9} {'tok/step':>8}")
    for length in lengths:
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in makes}
        for r in range(rounds):
            names = list(makes) if r % 2 == 0 else list(reversed(makes))
            for name in names:
                results[name].append(cost_round(makes[name], text, length, concurrency, steps, k, random.Random(r)))
        base = statistics.median(r[1] for r in results["ngram rescan (baseline)"])
        for name, rows in results.items():
            admit, step = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
            per = statistics.median(r[2] for r in rows)
            print(f"{length:>7} {name:<27} {admit:>12.2f} {step:>11.1f} {step / base:>8.2f}x {per:>8.2f}")
    t0 = time.perf_counter()
    p = SuffixProposer()
    for out in corpus_outputs:
        p.add_to_corpus(out)
    print(
        f"suffix corpus: adding an output costs {(time.perf_counter() - t0) / len(corpus_outputs) * 1e3:.2f} ms per 500 tokens"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["cost", "acceptance", "both"], default="both")
    parser.add_argument("--tokenizer", help="a folder with tokenizer.json (default: the default model's)")
    parser.add_argument("--k", type=int, default=8, help="draft tokens per step (the adaptive rows' k_max)")
    parser.add_argument("--doc-tokens", type=int, default=1500)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tok = load_tokenizer(args.tokenizer)
    if args.part in ("acceptance", "both"):
        run_acceptance(tok, args.k, args.doc_tokens)
    if args.part in ("cost", "both"):
        run_cost(tok, args.lengths, args.concurrency, args.steps, args.k, args.rounds)


if __name__ == "__main__":
    main()
