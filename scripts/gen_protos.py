"""Regenerates the Python gRPC stubs under chunkserve_contracts/ from protos/.

Run after editing a .proto: `python scripts/gen_protos.py`. tests/test_protos.py fails
when the committed stubs differ from what this script produces.

protoc names Python modules after the proto paths (`chunkserve/v1/...` -> `chunkserve.v1`);
the stubs live in the bottom package chunkserve_contracts instead, so their imports of each
other are rewritten (TGI post-processes its stubs the same way).
"""

from __future__ import annotations

import pathlib
import re
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ["chunkserve/v1/chunkserve.proto", "chunkserve/v1/replica.proto", "chunkserve/executor/v1/executor.proto"]


PACKAGE = "chunkserve_contracts"


def generate(out_dir: pathlib.Path) -> None:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto into out_dir/PACKAGE."""
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        for proto in PROTOS:
            rc = protoc.main(
                [
                    "protoc",
                    f"-I{ROOT / 'protos'}",
                    f"-I{include}",
                    f"--python_out={tmp}",
                    f"--pyi_out={tmp}",
                    f"--grpc_python_out={tmp}",
                    str(ROOT / "protos" / proto),
                ]
            )
            if rc != 0:
                raise SystemExit(f"protoc failed on {proto}")
        generated = pathlib.Path(tmp) / "chunkserve"
        for path in sorted(generated.rglob("*.py*")):
            target = out_dir / PACKAGE / path.relative_to(generated)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(re.sub(r"^(from|import) chunkserve\.", rf"\1 {PACKAGE}.", path.read_text(), flags=re.M))


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
