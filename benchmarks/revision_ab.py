"""Batch-1 plain decode of two checkouts of chunkserve, one server each, requests alternating.

Why: a change to the executor's kernels must not slow plain decoding, and on a shared 2-core
VM whose speed moves 10-30% between runs minutes apart only an interleaved comparison holds.
Each server runs the code of its own tree (`--old` and `--new`: checkouts, e.g. made with
`git worktree add /tmp/old <rev>`), in float32 on the default model, default flags; the
same greedy requests go to both, alternately (old, new, then new, old), and the decode
tok/s after the first token are compared, with each request's tokens. With `--streams N`
(N > 1) each measurement is N concurrent greedy streams instead (distinct prompts, ignore_eos,
the summed decode tok/s), and the tokens are not compared.

    .venv/bin/python benchmarks/revision_ab.py --old /tmp/old [--new .] [--rounds 3] [--streams 32]

The children must import each tree's packages: they start in a temporary directory with
PYTHONPATH set to a folder of links to the tree's package folders (the editable install would
map the names to the installed tree otherwise). A checkout from before 3150927 keeps its
attention backends in `kernels/`: its `chunkserve_kernels` link points there, and the tree
itself stays off the path, where that folder would shadow Hugging Face's `kernels`, which
transformers >= 5.25 imports. Nothing is written into the trees.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spec_decode import generate, streams_rate  # noqa: E402

PACKAGES = ("chunkserve", "chunkserve_contracts", "scheduler_svc", "executor_svc", "chunkserve_kernels")


def package_links(tree: Path, into: Path) -> Path:
    """A folder `into` of links, one per package, to the tree's package folders (either layout)."""
    into.mkdir(parents=True)
    for name in PACKAGES:
        folder = tree / name
        if name == "chunkserve_kernels" and not folder.is_dir():
            folder = tree / "kernels"  # the folder's name before 3150927
        if not (folder / "__init__.py").is_file():
            raise SystemExit(f"{tree} has no {name} package folder: not a chunkserve checkout?")
        (into / name).symlink_to(folder, target_is_directory=True)
    return into


PROMPTS = {
    "1.2K-token prompt": [(i * 37) % 40000 + 100 for i in range(1200)],
    "60-token prompt": [(i * 53) % 30000 + 200 for i in range(60)],
}


def main() -> None:
    from chunkserve.launch import start_server

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="checkout of the baseline revision")
    ap.add_argument("--new", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--streams", type=int, default=1, help="concurrent streams per measurement (1: one request)")
    args = ap.parse_args()
    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    tmp = Path(tempfile.mkdtemp())
    paths = {name: package_links(tree, tmp / f"{name}-packages") for name, tree in trees.items()}
    os.chdir(tmp)  # `python -m` puts the working directory first on the children's path
    servers = {}
    try:
        for name in trees:
            os.environ["PYTHONPATH"] = str(paths[name])
            servers[name] = start_server(tmp, ["--model", "default"], [])
        rates = {(n, p): [] for n in servers for p in PROMPTS}
        same = []
        for rnd in range(args.rounds):
            order = ["old", "new"] if rnd % 2 == 0 else ["new", "old"]
            for pname, prompt in PROMPTS.items():
                tokens = {}
                for n in order:
                    if args.streams > 1:  # stream i's prompt starts with i: no shared prefix blocks
                        prompts = [[i + 1, *prompt] for i in range(args.streams)]
                        rate = asyncio.run(streams_rate(servers[n].address, prompts, args.max_tokens))
                    else:
                        tokens[n], rate = asyncio.run(generate(servers[n].address, prompt, args.max_tokens))
                    rates[(n, pname)].append(rate)
                if args.streams == 1:
                    same.append(tokens["old"] == tokens["new"])
    finally:
        for server in servers.values():
            server.stop()
    streams = f", {args.streams} streams" if args.streams > 1 else ""
    print(
        f"old {trees['old']}  new {trees['new']}  {args.rounds} rounds, {args.max_tokens} tokens{streams}, decode tok/s"
    )
    for p in PROMPTS:
        old, new = statistics.median(rates[("old", p)]), statistics.median(rates[("new", p)])
        print(f"{p:20s} old {old:6.1f}  new {new:6.1f}  new/old {new / old:.3f}")
    if same:
        print("same tokens for every request:", all(same))


if __name__ == "__main__":
    main()
