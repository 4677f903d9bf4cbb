"""Shared fixtures: real two-process servers on free loopback ports."""
from __future__ import annotations

from pathlib import Path

import pytest

from chunkserve.launch import Server, start_server


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
