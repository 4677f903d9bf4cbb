"""Shared fixtures: real two-process servers on free loopback ports.

The suite never writes into the user's cache (~/.cache/chunkserve, or $CHUNKSERVE_CACHE_DIR).
Every default cache folder is a temporary one made for this run: what the tests measure there
(CPU linear plans) is gone with the run, so a plan measured on a loaded machine becomes neither
what a user's server serves with nor what the next test run serves with. Its `models/` links to
the repository's own .test-cache/models (or $CHUNKSERVE_TEST_CACHE_DIR/models), kept between
runs, so the default model is converted once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from chunkserve.launch import Server, start_server, write_tiny_model

TEST_CACHE_DIR = os.environ.get("CHUNKSERVE_TEST_CACHE_DIR") or str(Path(__file__).resolve().parents[1] / ".test-cache")


def pytest_configure(config: pytest.Config) -> None:
    """Before any test, fixture or server child: every default cache folder is this run's own."""
    models = Path(TEST_CACHE_DIR) / "models"
    models.mkdir(parents=True, exist_ok=True)
    run_cache = Path(tempfile.mkdtemp(prefix="chunkserve-test-cache-"))
    (run_cache / "models").symlink_to(models.resolve(), target_is_directory=True)
    os.environ["CHUNKSERVE_CACHE_DIR"] = str(run_cache)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's cache goes (the link to the kept models, not what it points at)."""
    run_cache = os.environ.get("CHUNKSERVE_CACHE_DIR", "")
    if Path(run_cache).name.startswith("chunkserve-test-cache-"):
        shutil.rmtree(run_cache, ignore_errors=True)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model, converted into the cache once (the first run takes ~30 s)."""
    from executor_svc.config import default_cache_dir
    from executor_svc.model_loader import resolve_model

    return resolve_model("default", Path(default_cache_dir()))


@pytest.fixture(scope="session")
def launch(tmp_path_factory):
    """Starts servers (start_server's arguments) and stops them all at the end of the session."""
    servers: list[Server] = []

    def _launch(executor_args: list[str], scheduler_args: list[str]) -> Server:
        server = start_server(tmp_path_factory.mktemp("server"), executor_args, scheduler_args)
        servers.append(server)
        return server

    yield _launch
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model_path(default_model_path, tmp_path_factory) -> Path:
    """A 2-layer random-weight Llama with SmolLM2's tokenizer: a real server in ~1 s, tokens
    are nonsense but every code path (tokenizer, chat template, vocab checks) is the real one."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), default_model_path)
