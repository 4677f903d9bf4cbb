"""The committed gRPC stubs are exactly what scripts/gen_protos.py generates from protos/."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    produced = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert produced, "the generator produced nothing"
    stale = [
        str(rel)
        for rel in produced
        if not (ROOT / rel).is_file() or (ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()
    ]
    assert not stale, f"stale stubs (run python scripts/gen_protos.py): {stale}"


def test_every_rpc_and_field_is_documented():
    """The protos are the public product: each RPC, message, field and enum value has a comment."""
    for proto in (ROOT / "protos").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_decl = stripped.startswith(("rpc ", "message ", "enum ")) or (
                stripped.endswith(";") and "=" in stripped and not stripped.startswith(("syntax", "option"))
            )
            if not is_decl or stripped.endswith("_UNSPECIFIED = 0;"):
                continue
            prev = lines[i - 1].strip()
            assert prev.startswith("//"), f"{proto.name}:{i + 1} undocumented: {stripped}"
