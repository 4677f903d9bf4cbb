"""`python -m chunkserve.bench ...` = `chunkserve bench ...`."""

from __future__ import annotations

import argparse
import sys

from chunkserve.bench.cli import add_bench_parser, run_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunkserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return run_bench(parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
