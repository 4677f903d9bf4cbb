"""Install layout and process boundaries: checked in fresh interpreters."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_python(code: str) -> str:
    """Runs code in a fresh interpreter from the repo root (where a stray `kernels` could shadow)."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_our_kernels_do_not_shadow_huggingface_kernels():
    """transformers probes for Hugging Face's `kernels` distribution; ours must not answer."""
    out = run_python(
        "import importlib.metadata as md, chunkserve_kernels\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "print(is_kernels_available(), 'kernels' in md.packages_distributions(),"
        " chunkserve_kernels.__name__)\n"
    )
    assert out.split() == ["False", "False", "chunkserve_kernels"]


def test_transformers_model_runs_beside_our_kernels():
    out = run_python(
        "import torch, chunkserve_kernels\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=1, vocab_size=50))\n"
        "print(m(torch.tensor([[1, 2, 3]])).logits.shape[-1])\n"
    )
    assert out.strip() == "50"


def test_scheduler_service_never_imports_torch(tmp_path):
    """Import every scheduler module and build a server object; torch must stay unloaded."""
    out = run_python(
        "import sys, pkgutil, importlib, scheduler_svc, chunkserve.cli, chunkserve.client\n"
        "for m in pkgutil.iter_modules(scheduler_svc.__path__):\n"
        "    importlib.import_module('scheduler_svc.' + m.name)\n"
        "import asyncio\n"
        "from scheduler_svc.app import SchedulerApp\n"
        "from scheduler_svc.config import SchedulerConfig\n"
        "async def main():\n"
        "    app = SchedulerApp(SchedulerConfig(port=0))\n"
        "    await app.server.start(); await app.server.stop(None)\n"
        "asyncio.run(main())\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    assert out.split() == ["False", "False"]


def test_dependency_floors_match_what_the_generated_stubs_require():
    """The stubs refuse to import below the grpcio and protobuf that generated them, so the
    floors in pyproject.toml must be exactly those versions (a lower floor installs a server
    that fails at import)."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for spec in project["dependencies"] + project["optional-dependencies"]["dev"]:
        m = re.match(r"([A-Za-z0-9_.-]+)\s*(?:>=|==)\s*([0-9.]+)", spec)
        if m:
            floors[m.group(1).lower()] = m.group(2)
    stubs = sorted((ROOT / "chunkserve_contracts").rglob("*_pb2*.py"))
    assert stubs
    for path in stubs:
        text = path.read_text()
        if path.name.endswith("_pb2_grpc.py"):
            needed = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", text).group(1)
            for dist in ("grpcio", "grpcio-health-checking", "grpcio-reflection", "grpcio-tools"):
                assert floors[dist] == needed, f"{dist} floor {floors[dist]} but {path.name} needs {needed}"
        else:
            needed = re.search(r"# Protobuf Python Version: ([0-9.]+)", text).group(1)
            assert floors["protobuf"] == needed, f"protobuf floor {floors['protobuf']} but {path.name} needs {needed}"


def test_every_import_points_down():
    """The layers: chunkserve_contracts (stubs, flags, tokens) <- scheduler_svc / executor_svc /
    kernels <- chunkserve (CLI, client, launcher, bench). No module imports a layer above its
    own, and the two services never import each other."""
    import ast

    above = {
        "chunkserve_contracts": {"chunkserve", "scheduler_svc", "executor_svc", "chunkserve_kernels"},
        "scheduler_svc": {"chunkserve", "executor_svc", "chunkserve_kernels"},
        "executor_svc": {"chunkserve", "scheduler_svc"},
        "kernels": {"chunkserve", "scheduler_svc", "executor_svc"},
    }
    bad = []
    for layer, forbidden in above.items():
        for path in (ROOT / layer).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module]
                    if isinstance(node, ast.ImportFrom) and node.module and not node.level
                    else []
                )
                bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0] in forbidden]
    assert not bad, bad
