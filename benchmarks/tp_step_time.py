"""Step time of the executor alone, TP=1 vs TP=N (tensor parallelism), and the share of a
step rank 0 spends inside collectives (waiting for the other ranks included).

Runs the same recorded plans — one prefill step of --batch prompts of --prompt tokens, then
--decode decode steps of the whole batch — through `python -m executor_svc.replay` once per
group size, with the CPU cores split between the ranks (--threads per rank = --cores / N),
and prints one line per size. Without --model it uses chunkserve.launch's tiny random model
shape (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 49152).

    python benchmarks/tp_step_time.py --tp 1 2 --cores 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chunkserve_contracts.executor.v1 import executor_pb2 as epb  # noqa: E402
from executor_svc.replay import write_messages  # noqa: E402

BLOCK = 16


def plans(batch: int, prompt: int, decode: int, vocab: int) -> list[epb.StepRequest]:
    greedy = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
    tables = {s: list(range(s * 64, s * 64 + -(-prompt // BLOCK))) for s in range(batch)}
    out = [
        epb.StepRequest(
            step_id=0,
            new_seqs=[epb.NewSequence(seq_id=s, sampling=greedy) for s in range(batch)],
            seqs=[
                epb.ScheduledSequence(
                    seq_id=s,
                    num_new_tokens=prompt,
                    token_ids=[(7 * s + i) % vocab for i in range(prompt)],
                    block_ids=tables[s],
                    sample=True,
                )
                for s in range(batch)
            ],
        )
    ]
    for k in range(decode):
        pos = prompt + k
        seqs = []
        for s in range(batch):
            fresh = [s * 64 + pos // BLOCK] if pos % BLOCK == 0 else []
            seqs.append(
                epb.ScheduledSequence(seq_id=s, num_computed_tokens=pos, num_new_tokens=1, block_ids=fresh, sample=True)
            )
        out.append(epb.StepRequest(step_id=k + 1, seqs=seqs))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: the tiny random model, written to a temp folder)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cores", type=int, default=2, help="CPU threads in all, split between the ranks")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--decode", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.model:
            model = Path(args.model)
        else:
            from chunkserve.launch import write_tiny_model

            model = write_tiny_model(tmp / "model", tmp)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        write_messages(tmp / "plans.bin", plans(args.batch, args.prompt, args.decode, vocab))
        print(
            f"model {model}, batch {args.batch}, prompt {args.prompt}, {args.decode} decode steps, {args.cores} cores"
        )
        for tp in args.tp:
            cmd = [sys.executable, "-m", "executor_svc.replay", "--plans", str(tmp / "plans.bin")]
            cmd += ["--out", str(tmp / "out.bin"), "--comm-out", str(tmp / "comm.json"), "--model", str(model)]
            cmd += ["--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override", str(64 * args.batch)]
            cmd += ["--tensor-parallel-size", str(tp), "--num-threads", str(max(1, args.cores // tp))]
            subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
            steps = json.loads((tmp / "comm.json").read_text())
            wall = [w / 1e6 for w, _ in steps[1:]]
            share = [c / w for w, c in steps[1:]]
            print(
                f"TP={tp}: prefill step {steps[0][0] / 1e6:.1f} ms (comm {steps[0][1] / steps[0][0]:.0%}), "
                f"decode step median {statistics.median(wall):.2f} ms (p90 {sorted(wall)[int(0.9 * len(wall))]:.2f}), "
                f"comm share of a decode step median {statistics.median(share):.0%}"
            )


if __name__ == "__main__":
    main()
