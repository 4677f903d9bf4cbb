"""benchmarks/spec_proposers.py runs (a byte-level tokenizer stands in for the default model's)
and its offline replay says what it should: copy-heavy edits are drafted, random tokens are not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from chunkserve.launch import write_byte_tokenizer

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "spec_proposers.py"


def run(tmp_path: Path, *args: str) -> list[list[str]]:
    tokenizer = write_byte_tokenizer(tmp_path / "tok")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--tokenizer", str(tokenizer), *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [line.split() for line in out.stdout.splitlines()]


def test_the_offline_replay_drafts_edits_and_not_random_tokens(tmp_path):
    rows = run(tmp_path, "--part", "acceptance", "--doc-tokens", "400", "--k", "6")
    by_workload: dict[str, list[float]] = {}
    for r in rows:
        if r and r[0] in ("edit-readme", "edit-code", "summarise", "random", "json-agent"):
            by_workload.setdefault(r[0], []).append(float(r[-1]))  # tok/step
    assert all(len(v) == 6 for v in by_workload.values()) and len(by_workload) == 5  # 3 methods x fixed/adaptive
    assert min(by_workload["edit-readme"]) > 2 and min(by_workload["edit-code"]) > 2
    assert by_workload["random"] == [1.0] * 6


def test_the_cost_part_prints_every_method_against_the_rescan(tmp_path):
    rows = run(tmp_path, "--part", "cost", "--lengths", "256", "--concurrency", "2", "--steps", "3", "--rounds", "1")
    table = [r for r in rows if r and r[0] == "256"]
    assert [" ".join(r[1:-4]) for r in table] == [
        "ngram rescan (baseline)",
        "ngram [2,5] incremental",
        "suffix, empty corpus",
        "suffix, 100-output corpus",
    ]
    assert table[0][-2] == "1.00x" and all(float(r[-3]) > 0 for r in table)
