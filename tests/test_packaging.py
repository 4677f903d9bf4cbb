"""Install layout and process boundaries: checked in fresh interpreters."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_python(code: str) -> str:
    """Runs code in a fresh interpreter from the repo root (first on its sys.path, as for a
    server started there)."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_no_package_in_the_repository_root_shadows_an_installed_one():
    """A process started in the repository root (`chunkserve serve`, scripts/quickstart.sh) has
    the root first on sys.path, so a package folder there named like another distribution's
    top-level module is imported in its place. Until 3150927 our attention backends' folder
    was kernels/: transformers >= 5.25 imports Hugging Face's `kernels` and the executor failed
    to start. The root's names are checked against every installed distribution's."""
    ours = sorted(p.stem for p in ROOT.iterdir() if (p / "__init__.py").is_file() or p.suffix == ".py")
    assert "chunkserve_kernels" in ours and "kernels" not in ours
    owners = json.loads(
        run_python("import importlib.metadata as md, json; print(json.dumps(md.packages_distributions()))")
    )
    clashes = {name: owners[name] for name in ours if set(owners.get(name, ["chunkserve"])) != {"chunkserve"}}
    assert not clashes, f"repository folders named like other distributions' modules: {clashes}"


def test_kernels_is_hugging_faces_or_absent_from_the_repository_root():
    """What transformers finds as `kernels` from the root is a file of the installed `kernels`
    distribution (transformers >= 5.25 requires it), or nothing (older ones), never ours."""
    out = run_python(
        "import importlib.metadata as md, importlib.util as u, json, pathlib\n"
        "spec = u.find_spec('kernels')\n"
        "dists = md.packages_distributions().get('kernels', [])\n"
        "files = {pathlib.Path(f.locate()).resolve() for d in dists for f in md.distribution(d).files or []}\n"
        "print(json.dumps([spec is not None, dists, spec is not None and pathlib.Path(spec.origin).resolve() in files]))\n"
    )
    found, dists, from_a_distribution = json.loads(out)
    assert "chunkserve" not in dists
    assert not found or from_a_distribution, out


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
        "chunkserve_kernels": {"chunkserve", "scheduler_svc", "executor_svc"},
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


def test_the_command_imports_only_the_subcommand_it_runs():
    """`chunkserve --version` and `--help` import no subcommand's module (so they work whatever
    is installed), and `chunkserve tune --help` the tuner's but neither torch nor the bench's."""
    out = run_python(
        "import contextlib, io, json, sys\n"
        "from chunkserve.cli import main\n"
        "names = ('chunkserve.bench', 'chunkserve.tune', 'chunkserve.admin_cli', 'chunkserve.client',"
        " 'scheduler_svc', 'executor_svc', 'torch')\n"
        "for argv in (['--version'], ['--help'], ['tune', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "    print(json.dumps(sorted(n for n in names if n in sys.modules)))\n"
    )
    version, help_, tune = (json.loads(line) for line in out.splitlines())
    assert version == help_ == []
    assert "chunkserve.tune" in tune and "torch" not in tune and "chunkserve.bench" not in tune, tune


def test_each_command_is_listed_with_its_own_help():
    """`chunkserve --help` lists the commands from chunkserve.cli.COMMANDS without importing
    them; each line must be the one the command's own parser gives."""
    from chunkserve.cli import COMMANDS, build_parser

    for name, (summary, _, _) in COMMANDS.items():
        parser = build_parser(name)  # this command's parser in full, from its own module
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        listed = {a.dest: a.help for a in sub._choices_actions}
        assert listed[name] == summary, f"{name}: its parser says {listed[name]!r}, COMMANDS {summary!r}"


# ---------------------------------------------------------------------------------------
# The wheel: what `pip install .` (or the Docker images) install is the wheel, not the source
# tree an editable install points at, so a package missing from it shows only there.

PACKAGES = {  # source folder -> the package it installs as
    "chunkserve": "chunkserve",
    "chunkserve_contracts": "chunkserve_contracts",
    "scheduler_svc": "scheduler_svc",
    "executor_svc": "executor_svc",
    "chunkserve_kernels": "chunkserve_kernels",
}


def _source_files(root: pathlib.Path, *patterns: str) -> list[str]:
    """The wheel paths of the files matching patterns in every package folder under root."""
    out = []
    for folder, package in PACKAGES.items():
        for pattern in patterns:
            out += [f"{package}/{p.relative_to(root / folder).as_posix()}" for p in (root / folder).rglob(pattern)]
    return sorted(out)


def _run(cmd: list, cwd: pathlib.Path, timeout: float = 600) -> str:
    # No PYTHONPATH and no activated environment: only what is installed in the venv answers.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.mark.slow
def test_the_wheel_installs_a_working_chunkserve_command(tmp_path):
    """Build the wheel (as `pip install .` and the Docker images do, build isolation included),
    check what it packs, install it into a fresh virtual environment with its base dependencies
    only (no executor extra: no torch) and run the commands from outside the repo, where its
    source folders cannot stand in for missing packages (~20 s, most of it pip)."""
    import shutil
    import zipfile

    from chunkserve_contracts import __version__

    # Built from a copy of the tree: a build in the repo leaves build/, whose stale files a
    # later build would pack. The copy keeps tests/, benchmarks/, docs/, scripts/, which must
    # stay out of the wheel.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"
    )
    shutil.copytree(ROOT, src, ignore=ignore)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp_path / "dist", src], cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("chunkserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    # Every module of every package, the data the code reads
    # at run time, and nothing else at the top level. (What the copy holds: the tree may be
    # edited meanwhile.)
    expected = _source_files(src, "*.py", "*.pyi", "*.cpp", "*.h") + ["chunkserve/bench/corpus.txt"]
    assert {"chunkserve/tune/cli.py", "chunkserve_kernels/csrc/cpu_ops.h"} <= set(expected)
    missing = sorted(set(expected) - names)
    assert not missing, f"not in the wheel: {missing}"
    top = {name.split("/")[0] for name in names}
    assert top == {*PACKAGES.values(), f"chunkserve-{__version__}.dist-info"}, top

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    bin_ = venv / "bin"
    _run([bin_ / "python", "-m", "pip", "install", "--quiet", wheel], cwd=tmp_path)  # not editable
    where = _run(
        [
            bin_ / "python",
            "-c",
            "import chunkserve.tune.cli, importlib.util as u; print(chunkserve.tune.cli.__file__);"
            " print(u.find_spec('chunkserve_kernels').origin); print(u.find_spec('torch') is None)",
        ],
        cwd=tmp_path,
    ).split()
    site = str(venv.resolve())
    assert all(path.startswith(site) for path in where[:2]), where  # the installed copies
    assert where[2] == "True"  # the base install carries no torch

    assert _run([bin_ / "chunkserve", "--version"], cwd=tmp_path).strip() == f"chunkserve {__version__}"
    listing = _run([bin_ / "chunkserve", "--help"], cwd=tmp_path)
    assert all(name in listing for name in ("serve", "generate", "bench", "admin", "tune"))
    assert "usage: chunkserve tune" in _run([bin_ / "chunkserve", "tune", "--help"], cwd=tmp_path)
    assert "--max-num-batched-tokens" in _run([bin_ / "python", "-m", "scheduler_svc", "--help"], cwd=tmp_path)
