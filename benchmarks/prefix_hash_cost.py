"""What the prefix cache's SHA-256 block keys cost, against Python's `hash()` they replaced.

Times `hash_block(parent, salt, tokens)` (what the scheduler computes once per full block a
request fills or looks up) and, as the baseline in the same run, `hash((parent, tokens,
salt))` over the same blocks: per block and for a whole prompt. Rounds alternate the two
(ABBA) so that neither is favoured by the machine warming up or being loaded.

    .venv/bin/python benchmarks/prefix_hash_cost.py                 # block size 16, 2048-token prompt
    .venv/bin/python benchmarks/prefix_hash_cost.py --block-size 256
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from scheduler_svc.block_pool import hash_block


def chain_sha256(blocks: list[tuple[int, ...]], salt: str | None) -> None:
    parent = None
    for chunk in blocks:
        parent = hash_block(parent, salt, chunk)


def chain_builtin(blocks: list[tuple[int, ...]], salt: str | None) -> None:
    parent = None
    for chunk in blocks:
        parent = hash((parent, chunk, salt))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--salt", default="tenant-42")
    args = parser.parse_args()
    rng = random.Random(0)
    num_blocks = args.prompt_len // args.block_size
    blocks = [tuple(rng.randrange(49152) for _ in range(args.block_size)) for _ in range(num_blocks)]
    times: dict[str, list[float]] = {"sha256": [], "hash()": []}
    fns = {"sha256": chain_sha256, "hash()": chain_builtin}
    for i in range(args.rounds):
        order = ["sha256", "hash()"] if i % 2 == 0 else ["hash()", "sha256"]
        for name in order:
            start = time.perf_counter()
            for _ in range(10):
                fns[name](blocks, args.salt)
            times[name].append((time.perf_counter() - start) / 10)
    sha, base = statistics.median(times["sha256"]), statistics.median(times["hash()"])
    print(
        f"block size {args.block_size}, {num_blocks} blocks ({args.prompt_len}-token prompt), "
        f"median of {args.rounds} alternating rounds"
    )
    print(f"{'key':<8} {'per block (us)':>15} {'per prompt (ms)':>16}")
    for name, t in (("sha256", sha), ("hash()", base)):
        print(f"{name:<8} {t / num_blocks * 1e6:>15.2f} {t * 1e3:>16.3f}")
    print(f"sha256 / hash(): {sha / base:.2f}x; extra per block {(sha - base) / num_blocks * 1e6:.2f} us")


if __name__ == "__main__":
    main()
