"""Regenerates the Python gRPC stubs under chunkserve/ from protos/.

Run after editing a .proto: `python scripts/gen_protos.py`. tests/test_protos.py fails
when the committed stubs differ from what this script produces.
"""
from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = [
    "chunkserve/v1/chunkserve.proto",
    "chunkserve/executor/v1/executor.proto",
]


def generate(out_dir: pathlib.Path) -> None:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto into out_dir."""
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    for proto in PROTOS:
        rc = protoc.main([
            "protoc",
            f"-I{ROOT / 'protos'}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(ROOT / "protos" / proto),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto}")


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
